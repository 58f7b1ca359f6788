//! The sequencer's metrics, registered on the registry the process serves at `/metrics`.

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};

use relay_rules::Outcome;

/// Event outcomes, all registered at 0 so dashboards see every series from the start.
pub const EVENT_OUTCOMES: [&str; 13] = [
    "stored",
    "unchanged",
    "removed",
    "refused",
    "ignored_duplicate",
    "ignored_older",
    "ignored_older_generation",
    "ignored_already_removed",
    "ignored_test",
    "ignored_reset",
    "ignored_unknown_type",
    "refetch_dropped",
    "refetch_reload",
];

pub const REFETCH_OUTCOMES: [&str; 6] = [
    "found",
    "not_found",
    "other_access_version",
    "load_balancer_404",
    "failed",
    "reload",
];

pub const RELOAD_OUTCOMES: [&str; 3] = ["started", "merged", "abandoned"];

/// The phases of a merged reload's time: reading the feed, and in all.
pub const RELOAD_READ: &str = "read";
pub const RELOAD_TOTAL: &str = "total";

/// The steps of an apply transaction, in order (see `apply_together`): each is one round trip
/// to Postgres but `decide`, the rules run in this process.
pub const APPLY_STEPS: [&str; 5] = ["begin", "open", "decide", "write", "commit"];

#[derive(Clone)]
pub struct SequencerMetrics {
    pub messages: IntCounterVec,
    /// Stored messages taken to apply, by where they were found ([`MESSAGE_SOURCES`]).
    pub messages_taken: IntCounterVec,
    pub events: IntCounterVec,
    pub apply_lag: Histogram,
    pub message_apply_duration: Histogram,
    pub apply_batch_runs: Histogram,
    /// Transactions of several runs that failed as a whole: their runs were applied one by one.
    pub apply_batches_split: IntCounter,
    pub apply_step_duration: HistogramVec,
    pub reloads_running: IntGauge,
    pub reloads: IntCounterVec,
    pub reload_duration: HistogramVec,
    pub refetches: IntCounterVec,
    /// Upstream reads that failed (no answer, a refused address or certificate, an error
    /// status), by the call that made them and why: what an operator alerts on before any copy
    /// lags.
    pub upstream_failures: IntCounterVec,
    /// Tasks pausing now after a failure (a reload, a stories sync, a stories read), by call:
    /// each pause longer than the one before, to the retry policy's cap.
    pub upstream_backing_off: IntGaugeVec,
    /// Reload passes (and stories syncs) holding one of the process's reload slots now.
    pub reload_passes_reading: IntGauge,
    /// Reload passes (and stories syncs) waiting for one of the process's reload slots now.
    pub reload_slot_waiting: IntGauge,
    /// How long each reload pass (or stories sync) waited for its slot.
    pub reload_slot_wait: Histogram,
    /// What each reload pass read: its answers' bytes, or their parsed weight when more.
    pub reload_pass_bytes: Histogram,
    pub endpoints_owned: IntGauge,
    pub lock_losses: IntCounter,
    pub applied_events_forgotten: IntCounter,
    /// Applied messages and published changes deleted after their retention.
    pub messages_forgotten: IntCounter,
    pub changes_forgotten: IntCounter,
    /// What each growing table holds, read by the retention task each round.
    pub table_bytes: IntGaugeVec,
    pub table_rows: GaugeVec,
    pub apply_failures: IntCounter,
    /// A stories endpoint's writes (seed 000's two), by what each did to its row.
    pub story_writes: IntCounterVec,
    /// Notifications claimed (each appended once to its tenant's stream).
    pub stories_notifications: IntCounter,
    /// Notifications claimed silently: their event was created before the endpoint's
    /// registration (relay-rules' `decide_notify`).
    pub stories_claims_silent: IntCounter,
    pub stories_catch_up_pages: IntCounter,
    /// Fetch-on-notify story reads, by answer (`failed`: each try that failed).
    pub story_reads: IntCounterVec,
    /// Story reads tried again at once after a failure.
    pub story_reads_retried: IntCounter,
    /// Reads owed (a story whose read still failed after its tries): `recorded` with a cursor's
    /// move, `done` by a later sync, `failing` again at a sync (tried later still).
    pub story_reads_owed: IntCounterVec,
    /// Reloads in full of stories endpoints, by how they ended.
    pub stories_reloads: IntCounterVec,
    /// Active stories endpoints whose reload in full runs or is owed, by which.
    pub stories_reloads_pending: IntGaugeVec,
    /// Tickers of active stories endpoints registered and not loaded yet.
    pub stories_tickers_loading: IntGauge,
    /// Active stories endpoints by how long ago they last caught up.
    pub stories_catch_up_age: IntGaugeVec,
    /// Stories of active stories endpoints owed a read now.
    pub stories_reads_owed: IntGauge,
}

/// The `source` labels of `relay_sequencer_messages_taken_total`: handed over by the front
/// tier of this process, or read from Postgres.
pub const MESSAGE_SOURCES: [&str; 2] = ["handed", "postgres"];

/// What a stories write did: a save that wrote or did not, a close that changed the row or
/// found it closed at that version already.
pub const STORY_WRITES: [&str; 4] = ["saved", "unchanged", "closed", "already_closed"];

pub const STORIES_RELOAD_OUTCOMES: [&str; 2] = ["finished", "superseded"];

/// What a story read answered.
pub const STORY_READ_ANSWERS: [&str; 3] = ["found", "not_found", "failed"];

/// What became of reads owed.
pub const STORY_READS_OWED: [&str; 3] = ["recorded", "done", "failing"];

/// Where a pending reload in full of a stories endpoint stands.
pub const STORIES_RELOADS_PENDING: [&str; 2] = ["running", "owed"];

impl SequencerMetrics {
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let messages = IntCounterVec::new(
            Opts::new(
                "relay_sequencer_messages_total",
                "Stored messages applied, by outcome.",
            ),
            &["outcome"],
        )?;
        let messages_taken = IntCounterVec::new(
            Opts::new(
                "relay_sequencer_messages_taken_total",
                "Stored messages taken to apply, by where they were found: handed over by the \
                 front tier of this process, or read from Postgres.",
            ),
            &["source"],
        )?;
        let events = IntCounterVec::new(
            Opts::new(
                "relay_sequencer_events_total",
                "Events of applied messages, by what they did to the copy.",
            ),
            &["outcome"],
        )?;
        let apply_lag = Histogram::with_opts(
            HistogramOpts::new(
                "relay_sequencer_apply_lag_seconds",
                "From a message's arrival at the front tier to its apply transaction's commit.",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
            ]),
        )?;
        let message_apply_duration = Histogram::with_opts(
            HistogramOpts::new(
                "relay_sequencer_message_apply_duration_seconds",
                "Time to apply one message (its refetch reads included).",
            )
            .buckets(prometheus::exponential_buckets(0.0005, 2.0, 14)?),
        )?;
        let apply_batch_runs = Histogram::with_opts(
            HistogramOpts::new(
                "relay_sequencer_apply_batch_runs",
                "Endpoints' runs applied in one transaction.",
            )
            .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]),
        )?;
        let apply_batches_split = IntCounter::new(
            "relay_sequencer_apply_batches_split_total",
            "Transactions of several endpoints' runs that failed as a whole, their runs then \
             applied one by one (group commit lost for that batch).",
        )?;
        let apply_step_duration = HistogramVec::new(
            HistogramOpts::new(
                "relay_sequencer_apply_step_seconds",
                "Time of each step of an apply transaction (begin, open, decide, write, \
                 commit): where an applied message's wait goes.",
            )
            .buckets(prometheus::exponential_buckets(0.00025, 2.0, 15)?),
            &["step"],
        )?;
        let reloads_running = IntGauge::new(
            "relay_sequencer_reloads_running",
            "Reloads this process is reading or merging now.",
        )?;
        let reloads = IntCounterVec::new(
            Opts::new(
                "relay_sequencer_reloads_total",
                "Reloads started, merged and abandoned (superseded, or ownership lost).",
            ),
            &["outcome"],
        )?;
        let reload_duration = HistogramVec::new(
            HistogramOpts::new(
                "relay_sequencer_reload_duration_seconds",
                "Time from a reload's start in this process to its merge, by phase.",
            )
            .buckets(prometheus::exponential_buckets(0.01, 2.0, 14)?),
            &["phase"],
        )?;
        let refetches = IntCounterVec::new(
            Opts::new(
                "relay_sequencer_refetches_total",
                "Refetch item reads, by answer.",
            ),
            &["outcome"],
        )?;
        let upstream_failures = IntCounterVec::new(
            Opts::new(
                "relay_sequencer_upstream_failures_total",
                "Upstream API reads that failed, by call (reload, refetch, endpoint, events, \
                 stories, story, stories_sync) and kind (as the endpoint's state names it: \
                 connect, timeout, status, certificate_unknown_issuer, load_balancer_404, \
                 too_large, invalid, body, store, ...).",
            ),
            &["call", "kind"],
        )?;
        let upstream_backing_off = IntGaugeVec::new(
            Opts::new(
                "relay_sequencer_upstream_backing_off",
                "Tasks pausing after a failure now, by call (reload, stories_sync, story).",
            ),
            &["call"],
        )?;
        let reload_passes_reading = IntGauge::new(
            "relay_sequencer_reload_passes_reading",
            "Reload passes and stories syncs holding one of this process's reload slots \
             (RELAY_SEQUENCER_MAX_CONCURRENT_RELOADS).",
        )?;
        let reload_slot_waiting = IntGauge::new(
            "relay_sequencer_reload_slot_waiting",
            "Reload passes and stories syncs waiting for one of this process's reload slots \
             (their tenant's share of them, RELAY_SEQUENCER_MAX_TENANT_SHARE, or every slot, \
             held).",
        )?;
        let reload_slot_wait = Histogram::with_opts(
            HistogramOpts::new(
                "relay_sequencer_reload_slot_wait_seconds",
                "How long each reload pass or stories sync waited for its reload slot (0 when \
                 one was free).",
            )
            .buckets(prometheus::exponential_buckets(0.001, 4.0, 10)?),
        )?;
        let reload_pass_bytes = Histogram::with_opts(
            HistogramOpts::new(
                "relay_sequencer_reload_pass_bytes",
                "What each reload pass read: its answers' bytes, or the memory their parsed \
                 values take when more (bounded by RELAY_SEQUENCER_MAX_RELOAD_BYTES).",
            )
            .buckets(prometheus::exponential_buckets(65_536.0, 4.0, 10)?),
        )?;
        let endpoints_owned = IntGauge::new(
            "relay_sequencer_endpoints_owned",
            "Endpoints this process holds the lock of now.",
        )?;
        let lock_losses = IntCounter::new(
            "relay_sequencer_lock_losses_total",
            "Times this process lost an endpoint's lock (lease not renewed, or fence moved on).",
        )?;
        let applied_events_forgotten = IntCounter::new(
            "relay_sequencer_applied_events_forgotten_total",
            "Applied event ids deleted after their retention.",
        )?;
        let messages_forgotten = IntCounter::new(
            "relay_sequencer_messages_forgotten_total",
            "Applied messages deleted after their retention (with how they applied).",
        )?;
        let changes_forgotten = IntCounter::new(
            "relay_sequencer_changes_forgotten_total",
            "Published changes deleted after their retention.",
        )?;
        let table_bytes = IntGaugeVec::new(
            Opts::new(
                "relay_table_bytes",
                "Size on disk of each table that grows with traffic, with its indexes and TOAST.",
            ),
            &["table"],
        )?;
        let table_rows = GaugeVec::new(
            Opts::new(
                "relay_table_rows_estimate",
                "Rows of each table that grows with traffic, as Postgres last estimated them.",
            ),
            &["table"],
        )?;
        let apply_failures = IntCounter::new(
            "relay_sequencer_apply_failures_total",
            "Failed applies of a message alone that its content may have caused (each is one \
             of its tries before quarantine).",
        )?;
        let story_writes = IntCounterVec::new(
            Opts::new(
                "relay_sequencer_story_writes_total",
                "Writes to stories endpoints' copies, by what each did to its row.",
            ),
            &["write"],
        )?;
        let stories_notifications = IntCounter::new(
            "relay_sequencer_stories_notifications_total",
            "Notifications claimed and appended to tenants' streams.",
        )?;
        let stories_claims_silent = IntCounter::new(
            "relay_sequencer_stories_claims_silent_total",
            "Notifications claimed and not sent: their event was created before the endpoint \
             was registered.",
        )?;
        let stories_catch_up_pages = IntCounter::new(
            "relay_sequencer_stories_catch_up_pages_total",
            "Pages of GET /v1/events applied by stories endpoints' catch-up.",
        )?;
        let stories_reloads = IntCounterVec::new(
            Opts::new(
                "relay_sequencer_stories_reloads_total",
                "Reloads in full of stories endpoints' copies, by how they ended.",
            ),
            &["outcome"],
        )?;
        let stories_reloads_pending = IntGaugeVec::new(
            Opts::new(
                "relay_sequencer_stories_reloads_pending",
                "Active stories endpoints whose reload in full is running or owed, as the \
                 retention task last counted them.",
            ),
            &["reload"],
        )?;
        let stories_tickers_loading = IntGauge::new(
            "relay_sequencer_stories_tickers_loading",
            "Tickers of active stories endpoints registered and not loaded yet, as the \
             retention task last counted them.",
        )?;
        let stories_catch_up_age = IntGaugeVec::new(
            Opts::new(
                "relay_sequencer_stories_catch_up_age_endpoints",
                "Active stories endpoints by how long ago they last caught up (within_1m, \
                 within_5m, within_1h, older, never), as the retention task last counted them.",
            ),
            &["age"],
        )?;
        let stories_reads_owed = IntGauge::new(
            "relay_sequencer_stories_reads_owed",
            "Stories of active stories endpoints owed a read (their fetch-on-notify read still \
             failed after its tries), as the retention task last counted them.",
        )?;
        registry.register(Box::new(stories_reads_owed.clone()))?;
        registry.register(Box::new(stories_reloads_pending.clone()))?;
        registry.register(Box::new(stories_tickers_loading.clone()))?;
        registry.register(Box::new(stories_catch_up_age.clone()))?;
        for reload in STORIES_RELOADS_PENDING {
            stories_reloads_pending.with_label_values(&[reload]);
        }
        for (age, _) in relay_store::stories::CATCH_UP_AGES {
            stories_catch_up_age.with_label_values(&[age]);
        }
        let story_reads = IntCounterVec::new(
            Opts::new(
                "relay_sequencer_story_reads_total",
                "GET /v1/stories/{id} reads of stories endpoints, by answer (found, not_found, \
                 failed: each try that failed).",
            ),
            &["answer"],
        )?;
        let story_reads_retried = IntCounter::new(
            "relay_sequencer_story_reads_retried_total",
            "Story reads tried again at once after a failed try.",
        )?;
        let story_reads_owed = IntCounterVec::new(
            Opts::new(
                "relay_sequencer_story_reads_owed_total",
                "Story reads owed after their tries failed: recorded (with the cursor's move), \
                 done (by a later sync), failing (again, at a sync).",
            ),
            &["what"],
        )?;
        registry.register(Box::new(story_reads.clone()))?;
        registry.register(Box::new(story_reads_retried.clone()))?;
        registry.register(Box::new(story_reads_owed.clone()))?;
        for answer in STORY_READ_ANSWERS {
            story_reads.with_label_values(&[answer]);
        }
        for what in STORY_READS_OWED {
            story_reads_owed.with_label_values(&[what]);
        }
        registry.register(Box::new(story_writes.clone()))?;
        registry.register(Box::new(stories_notifications.clone()))?;
        registry.register(Box::new(stories_claims_silent.clone()))?;
        registry.register(Box::new(stories_catch_up_pages.clone()))?;
        registry.register(Box::new(stories_reloads.clone()))?;
        for write in STORY_WRITES {
            story_writes.with_label_values(&[write]);
        }
        for outcome in STORIES_RELOAD_OUTCOMES {
            stories_reloads.with_label_values(&[outcome]);
        }
        registry.register(Box::new(applied_events_forgotten.clone()))?;
        registry.register(Box::new(messages_forgotten.clone()))?;
        registry.register(Box::new(changes_forgotten.clone()))?;
        registry.register(Box::new(table_bytes.clone()))?;
        registry.register(Box::new(table_rows.clone()))?;
        registry.register(Box::new(apply_failures.clone()))?;
        registry.register(Box::new(messages.clone()))?;
        registry.register(Box::new(messages_taken.clone()))?;
        for source in MESSAGE_SOURCES {
            messages_taken.with_label_values(&[source]);
        }
        registry.register(Box::new(events.clone()))?;
        registry.register(Box::new(apply_lag.clone()))?;
        registry.register(Box::new(message_apply_duration.clone()))?;
        registry.register(Box::new(apply_batch_runs.clone()))?;
        registry.register(Box::new(apply_batches_split.clone()))?;
        registry.register(Box::new(apply_step_duration.clone()))?;
        registry.register(Box::new(reloads_running.clone()))?;
        registry.register(Box::new(reloads.clone()))?;
        registry.register(Box::new(reload_duration.clone()))?;
        registry.register(Box::new(refetches.clone()))?;
        registry.register(Box::new(upstream_failures.clone()))?;
        registry.register(Box::new(upstream_backing_off.clone()))?;
        registry.register(Box::new(reload_passes_reading.clone()))?;
        registry.register(Box::new(reload_slot_waiting.clone()))?;
        registry.register(Box::new(reload_slot_wait.clone()))?;
        registry.register(Box::new(reload_pass_bytes.clone()))?;
        for call in ["reload", "stories_sync", "story"] {
            upstream_backing_off.with_label_values(&[call]);
        }
        registry.register(Box::new(endpoints_owned.clone()))?;
        registry.register(Box::new(lock_losses.clone()))?;
        for outcome in Outcome::ALL {
            messages.with_label_values(&[outcome.as_str()]);
        }
        for outcome in EVENT_OUTCOMES {
            events.with_label_values(&[outcome]);
        }
        for outcome in REFETCH_OUTCOMES {
            refetches.with_label_values(&[outcome]);
        }
        for outcome in RELOAD_OUTCOMES {
            reloads.with_label_values(&[outcome]);
        }
        for phase in [RELOAD_READ, RELOAD_TOTAL] {
            reload_duration.with_label_values(&[phase]);
        }
        for step in APPLY_STEPS {
            apply_step_duration.with_label_values(&[step]);
        }
        Ok(Self {
            messages,
            messages_taken,
            events,
            apply_lag,
            message_apply_duration,
            apply_batch_runs,
            apply_batches_split,
            apply_step_duration,
            reloads_running,
            reloads,
            reload_duration,
            refetches,
            upstream_failures,
            upstream_backing_off,
            reload_passes_reading,
            reload_slot_waiting,
            reload_slot_wait,
            reload_pass_bytes,
            endpoints_owned,
            lock_losses,
            applied_events_forgotten,
            messages_forgotten,
            changes_forgotten,
            table_bytes,
            table_rows,
            apply_failures,
            story_writes,
            stories_notifications,
            stories_claims_silent,
            stories_catch_up_pages,
            story_reads,
            story_reads_retried,
            story_reads_owed,
            stories_reloads,
            stories_reloads_pending,
            stories_tickers_loading,
            stories_catch_up_age,
            stories_reads_owed,
        })
    }

    /// Sets the stories gauges from one count of every active stories endpoint's sync.
    pub fn observe_stories(&self, summary: &relay_store::stories::SyncSummary) {
        let [running, owed] = STORIES_RELOADS_PENDING;
        let pending = &self.stories_reloads_pending;
        pending
            .with_label_values(&[running])
            .set(summary.reloads_running);
        pending.with_label_values(&[owed]).set(summary.reloads_owed);
        self.stories_tickers_loading.set(summary.tickers_loading);
        self.stories_reads_owed.set(summary.reads_owed);
        for ((age, _), endpoints) in relay_store::stories::CATCH_UP_AGES
            .iter()
            .zip(summary.catch_up_ages)
        {
            self.stories_catch_up_age
                .with_label_values(&[age])
                .set(endpoints);
        }
    }

    /// A committed run's messages: each one's share of the run's time since `started` (its
    /// reads included), and its lag from arrival to `now`.
    pub(crate) fn observe_applied(
        &self,
        started: std::time::Instant,
        pending: &[relay_store::cursors::PendingMessage],
        now: time::OffsetDateTime,
    ) {
        let per_message = started.elapsed().as_secs_f64() / pending.len().max(1) as f64;
        for message in pending {
            self.message_apply_duration.observe(per_message);
            self.apply_lag
                .observe((now - message.received_at).as_seconds_f64().max(0.0));
        }
    }

    /// Metrics on a private registry: for tests and tools that do not serve them.
    pub fn unregistered() -> Self {
        Self::register(&Registry::new()).expect("a fresh registry takes every metric")
    }
}
