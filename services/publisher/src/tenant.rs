//! One owned tenant: its endpoints' unpublished changes streamed to the broker, each confirmed
//! change marked published, until the tenant has been idle a while, its lease is lost, or the
//! publisher stops.
//!
//! # Order
//! Each endpoint sends up to `endpoint_window` changes before the first of them is confirmed,
//! in change_seq order, on the tenant's one channel, whose publishes reach the queue in the
//! order they were made; the tenant has at most `max_in_flight` publishes awaiting a confirm,
//! whichever endpoints they are of, and endpoints take turns. So a busy endpoint drains at the
//! broker's speed rather than at one round trip per change, and a confirm frees its place in
//! the window at once, with no round to wait for. The books are [`Stream`]'s (`stream.rs`,
//! pure, with its tests).
//!
//! Going back: when a change of an endpoint is nacked or returned, it and every change of the
//! endpoint sent after it go back to the head of its queue and are sent again from there, in
//! order, after the pause below; when the channel is lost (or a confirm does not come in time,
//! which drops it), every change sent and not yet confirmed in turn goes back. The broker may
//! hold some of the first copies (a change accepted behind one refused), but the last copy of
//! every change_seq is published after the last copy of every earlier one: a consumer that
//! drops what it applied already and holds a change that comes ahead of its predecessor gets
//! each change once, in order. The outcome of a publish that was put back (a late ack) is
//! ignored: its resend's counts. Confirms may come in any order; only the run of confirmed
//! changes at the front of an endpoint's window is taken as confirmed and marked.
//!
//! # Finding changes
//! The sequencer announces each endpoint that got new changes (a Redis message, see
//! `relay_coord::changes_channel`); the coordinator hands it to the owning task, which
//! reads that endpoint's next changes. The coordinator's poll asks for a sweep now and then
//! (every endpoint of the tenant with a backlog), which finds what an announcement lost. Changes
//! read wait in memory, a bounded number per endpoint (twice its window, at least 16) and per
//! tenant (16 times `max_in_flight`, whatever the windows); what has been read, `held_through`,
//! is remembered while the tenant is owned, so a later read never returns a change already
//! sent. A busy endpoint is read again once half its read-ahead is free, so its queue refills
//! while its window is in flight. A change of a newer epoch drops what is held of the older one.
//!
//! When the sequencer runs in this process, it hands the changes it commits for the tenant to
//! the task in memory (`relay_coord::Handoff`) instead of announcing them. A handed change is
//! taken when it follows on from what the task holds of its endpoint (the next change_seq of the
//! same epoch, with room for it); otherwise the endpoint is read from the outbox, which holds the
//! same changes.
//!
//! # Nothing waits in the loop
//! The loop itself only keeps the books. A read of the outbox runs in a task of its own (one at
//! a time), and so do marks and the backlog gauges' refresh; a publish is handed to lapin and
//! awaited, with its confirm, among the other confirms. So a slow statement or a slow broker
//! never stops the loop from taking confirms and sending each endpoint's next changes.
//!
//! # Marking
//! Changes confirmed in turn are marked published in batches, one statement at a time beside the
//! sending: a mark starts once the first change confirmed since the last one has waited
//! `mark_interval`, or once half the bound of confirmed-but-unmarked changes waits, and takes
//! everything confirmed by then. It moves one row per endpoint, so the longer the interval the
//! fewer rows a change costs. A mark is only bookkeeping (it keeps a change from being sent
//! again after a restart), so sending does not wait for it, up to that bound.
//!
//! # Broker trouble
//! Nothing is marked unless confirmed, so the backlog stays in Postgres whatever happens. A
//! failed connect, a closed channel or connection, or a confirm that does not come in time drops
//! the connection (nothing is sent on another channel while a publish on the old one awaits its
//! confirm); every endpoint's changes sent and not confirmed in turn go back to the head of
//! their queues, and sending resumes after a pause (doubled each failure in a row, with jitter,
//! up to `retry_max`). A return (the queue was deleted under us) or a nack sends the change
//! again, with every change of its endpoint sent after it, after the same pause; a return
//! declares the queue again first. Every wait is bounded, and each tenant has a task and a
//! channel of its own (and a connection of its own when its destination is its own broker), so
//! a tenant whose broker does not answer holds up only itself.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::stream::FuturesUnordered;
use futures::{FutureExt as _, StreamExt as _};
use time::OffsetDateTime;
use tokio::sync::{watch, Notify};
use uuid::Uuid;

use relay_netguard::Pauses;
use relay_store::changes::{self, Marked, Unpublished};
use relay_store::{destinations, EndpointId, TenantId};

use crate::broker::{classify, publish, BrokerError, Link, Outcome, Target};
use crate::outbox::{OutboxChange, OutboxError};
use crate::ownership::TenantHeld;
use crate::publisher::Shared;
use crate::stream::{Acked, Limits, SendId, Stream};

/// Most endpoints asked about in one read of the outbox.
const ENDPOINTS_PER_READ: usize = 1_000;

/// What the coordinator tells a tenant's task.
#[derive(Default)]
pub(crate) struct TenantSignal {
    notify: Notify,
    endpoints: Mutex<HashSet<Uuid>>,
    sweep: AtomicBool,
}

impl TenantSignal {
    /// The sequencer announced new changes of `endpoint`.
    pub(crate) fn endpoint(&self, endpoint: Uuid) {
        self.endpoints
            .lock()
            .expect("not poisoned")
            .insert(endpoint);
        self.notify.notify_one();
    }

    /// The poll saw a backlog: look at every endpoint.
    pub(crate) fn sweep(&self) {
        self.sweep.store(true, Ordering::SeqCst);
        self.notify.notify_one();
    }

    fn take(&self) -> (HashSet<Uuid>, bool) {
        let endpoints = std::mem::take(&mut *self.endpoints.lock().expect("not poisoned"));
        (endpoints, self.sweep.swap(false, Ordering::SeqCst))
    }
}

/// Why a tenant's task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Shutdown,
    Idle,
    /// The lease ran out: not ours to release.
    Lost,
    /// The tenant's publishing token moved on (another publisher claimed it, or a resync or a
    /// replay took it to move the stream): the lease, while still ours, is given back, so the
    /// successor (this process's next task, often) need not wait for it to run out. Releasing
    /// takes the lock only if it still holds this task's value.
    Fenced,
}

/// Runs one owned tenant until it is idle, lost, or the publisher stops.
pub(crate) async fn run(
    shared: Arc<Shared>,
    held: TenantHeld,
    signal: Arc<TenantSignal>,
    shutdown: watch::Receiver<bool>,
) {
    let tenant = held.key();
    let pauses = shared.config.retry().pauses();
    let limits = Limits::new(shared.config.max_in_flight, shared.config.endpoint_window);
    let mut worker = Worker {
        label: tenant.to_string(),
        tenant,
        shared,
        held,
        signal,
        shutdown,
        link: None,
        target: None,
        pauses,
        stream: Stream::new(limits),
        confirms: FuturesUnordered::new(),
        marking: None,
        reading: None,
        refreshing: None,
        hold_until: None,
        redeclare: false,
        refusal_recorded: None,
        inbox: None,
    };
    // Opened before the first read: what the sequencer hands over from now on is either in the
    // inbox or in what that read finds.
    worker.inbox = worker
        .shared
        .config
        .changes_handoff
        .as_ref()
        .map(|handoff| handoff.open(tenant));
    let end = worker.run().await;
    tracing::info!(%tenant, ?end, "publisher gives the tenant up");
    if let Some(refreshing) = worker.refreshing.take() {
        // Its gauges are about to be forgotten; a late refresh would bring them back.
        refreshing.abort();
        let _ = refreshing.await;
    }
    let Worker {
        shared,
        held,
        link,
        label,
        ..
    } = worker;
    if let Some(link) = link {
        link.close().await;
    }
    shared.metrics.forget_tenant(&label);
    match end {
        End::Lost => shared.metrics.ownership_losses.inc(),
        End::Fenced => {
            shared.metrics.ownership_losses.inc();
            held.release().await;
        }
        End::Shutdown | End::Idle => {
            held.release().await;
        }
    }
}

/// A confirm awaited: the endpoint, the change_seq, the publish, and what became of it.
type ConfirmFuture = Pin<Box<dyn Future<Output = (Uuid, i64, SendId, Confirmed)> + Send>>;
/// A mark running: the keys it marks, and its result.
type MarkFuture =
    Pin<Box<dyn Future<Output = (Vec<(Uuid, i64)>, Result<Marked, OutboxError>)> + Send>>;

enum Confirmed {
    Outcome(Outcome),
    /// The publish itself failed: nothing reached the broker, or it is in doubt.
    NotSent(BrokerError),
    /// Sent; no confirm came.
    Failed(BrokerError),
}

/// A read of the outbox running beside the loop (see [`Worker::start_read`]).
type ReadFuture = Pin<Box<dyn Future<Output = ReadDone> + Send>>;

enum ReadDone {
    /// The tenant's endpoints with a backlog, each with its last change_seq; `None` when the
    /// tenant's publishing token moved on (see `changes::endpoints_with_backlog`).
    Swept(Result<Option<Vec<(Uuid, i64)>>, OutboxError>),
    /// The next changes of the endpoints asked for (endpoint, room asked).
    Changes(Vec<(Uuid, usize)>, Result<Vec<OutboxChange>, OutboxError>),
}

struct Worker {
    tenant: Uuid,
    label: String,
    shared: Arc<Shared>,
    held: TenantHeld,
    signal: Arc<TenantSignal>,
    shutdown: watch::Receiver<bool>,
    link: Option<Link>,
    target: Option<Target>,
    /// The pauses after trouble, from the first again after each confirm.
    pauses: Pauses,
    stream: Stream,
    confirms: FuturesUnordered<ConfirmFuture>,
    marking: Option<MarkFuture>,
    reading: Option<ReadFuture>,
    /// The backlog gauges' refresh, when one runs.
    refreshing: Option<tokio::task::JoinHandle<()>>,
    /// Nothing is sent before this (a pause after broker trouble).
    hold_until: Option<Instant>,
    /// A publish came back unroutable: declare the queue before sending again.
    redeclare: bool,
    /// What was last written of the destination's refusal (`Some(None)`: cleared).
    refusal_recorded: Option<Option<String>>,
    /// The changes this process's sequencer hands over for the tenant, when it runs here.
    inbox: Option<relay_coord::Inbox<Unpublished>>,
}

/// What woke the loop.
enum Woke {
    Confirm(Uuid, i64, SendId, Confirmed),
    Marked(Vec<(Uuid, i64)>, Result<Marked, OutboxError>),
    Read(ReadDone),
    Other,
}

impl Worker {
    async fn run(&mut self) -> End {
        let config = self.shared.config.clone();
        let now = Instant::now();
        let mut next_metrics = now;
        let mut next_destination = now;
        let mut idle_since = now;
        self.stream.sweep = true;
        loop {
            if *self.shutdown.borrow() {
                return self.wind_down().await;
            }
            if self.held.is_lost() {
                return End::Lost;
            }
            let now = Instant::now();
            if self.hold_until.is_some_and(|until| until <= now) {
                self.hold_until = None;
            }
            if now >= next_metrics {
                next_metrics = now + config.metrics_interval;
                self.refresh_backlog_metrics();
            }
            // A new destination closes the link: wait until nothing is in flight on it.
            if (now >= next_destination && self.confirms.is_empty()) || self.target.is_none() {
                next_destination = now + config.destination_refresh;
                if let Err(error) = self.refresh_target().await {
                    self.postgres_trouble("destination");
                    tracing::warn!(tenant = %self.tenant, error = %error, "reading the destination failed");
                    self.hold();
                }
            }

            let (endpoints, sweep) = self.signal.take();
            self.stream.wanted.extend(endpoints);
            self.stream.sweep |= sweep;
            self.take_handed();
            if self.reading.is_none()
                && self.hold_until.is_none()
                && self.stream.held() < self.stream.limits().max_held
                && (self.stream.sweep || !self.stream.wanted.is_empty())
            {
                self.start_read();
            }

            if self.stream.is_empty()
                && self.stream.wanted.is_empty()
                && self.confirms.is_empty()
                && self.marking.is_none()
                && self.reading.is_none()
            {
                if now.duration_since(idle_since) >= config.idle_release {
                    return End::Idle;
                }
            } else {
                idle_since = now;
            }

            if self.may_send() {
                self.send_ready().await;
            }
            // A failed mark holds too, so Postgres trouble is not retried in a tight loop.
            let mark_at = self.mark_due_at();
            if self.marking.is_none()
                && self.hold_until.is_none()
                && mark_at.is_some_and(|at| at <= now)
            {
                self.start_mark();
            }

            let mut deadline = next_metrics;
            if let Some(at) = mark_at.filter(|_| self.marking.is_none()) {
                deadline = deadline.min(at);
            }
            if let Some(until) = self.hold_until {
                deadline = deadline.min(until);
            }
            if self.stream.is_empty() {
                deadline = deadline.min(idle_since + config.idle_release);
            }
            let (confirms, marking, reading) =
                (&mut self.confirms, &mut self.marking, &mut self.reading);
            let (notify, shutdown, held) = (&self.signal.notify, &mut self.shutdown, &self.held);
            let inbox = &self.inbox;
            let woke = tokio::select! {
                () = async { inbox.as_ref().expect("guarded").handed().await },
                    if inbox.is_some() => Woke::Other,
                Some((endpoint, seq, id, confirmed)) = confirms.next(), if !confirms.is_empty() => {
                    Woke::Confirm(endpoint, seq, id, confirmed)
                }
                (keys, result) = async { marking.as_mut().expect("guarded").await },
                    if marking.is_some() => Woke::Marked(keys, result),
                done = async { reading.as_mut().expect("guarded").await },
                    if reading.is_some() => Woke::Read(done),
                _ = notify.notified() => Woke::Other,
                _ = tokio::time::sleep_until(deadline.into()) => Woke::Other,
                _ = shutdown.changed() => Woke::Other,
                () = held.lost() => Woke::Other,
            };
            match woke {
                Woke::Confirm(endpoint, seq, id, confirmed) => {
                    self.on_confirm(endpoint, seq, id, confirmed).await;
                    // Take every other confirm that is in, so they are marked together.
                    while let Some(Some((endpoint, seq, id, confirmed))) =
                        self.confirms.next().now_or_never()
                    {
                        self.on_confirm(endpoint, seq, id, confirmed).await;
                    }
                }
                Woke::Marked(keys, result) => {
                    self.marking = None;
                    if !self.on_marked(keys, result) {
                        if let Some(link) = self.link.take() {
                            link.close().await;
                        }
                        return End::Fenced;
                    }
                }
                Woke::Read(done) => {
                    self.reading = None;
                    if !self.on_read(done) {
                        if let Some(link) = self.link.take() {
                            link.close().await;
                        }
                        return End::Fenced;
                    }
                }
                Woke::Other => {}
            }
        }
    }

    /// Takes what this process's sequencer handed over since the last look.
    fn take_handed(&mut self) {
        let Some(inbox) = &self.inbox else {
            return;
        };
        let handed = inbox.take();
        if handed.is_empty() {
            return;
        }
        let mut changes = Vec::with_capacity(handed.len());
        for row in handed {
            let endpoint = row.endpoint.as_uuid();
            match OutboxChange::from_row(self.tenant, row) {
                Ok(change) => changes.push(change),
                // The outbox holds the same row: reading it fails as loudly, where reads do.
                Err(_) => {
                    self.stream.wanted.insert(endpoint);
                }
            }
        }
        let taken = self.stream.add_handed(changes);
        self.shared
            .metrics
            .changes_taken
            .with_label_values(&["handed"])
            .inc_by(taken);
    }

    /// When the changes confirmed and not marked are due to be marked: `mark_interval` after
    /// the first of them, or now once half the bound of them waits. `None`: none waits.
    fn mark_due_at(&self) -> Option<Instant> {
        let first = self.stream.first_unmarked_at()?;
        if self.stream.unmarked() * 2 >= self.stream.limits().max_held {
            return Some(first);
        }
        Some(first + self.shared.config.mark_interval)
    }

    fn may_send(&self) -> bool {
        let held = self.hold_until.is_some_and(|until| Instant::now() < until);
        // The stream also stops sending while a mark does not finish (Postgres down), so what
        // would be sent again after a crash stays bounded.
        !held && self.stream.may_send()
    }

    /// Sends what the windows and the tenant's bound allow, endpoints taking turns (opening the
    /// link first if need be).
    async fn send_ready(&mut self) {
        let config = self.shared.config.clone();
        let link = match self.link.take() {
            Some(link) if link.is_open() => link,
            // The channel closed under publishes still awaiting their confirm: they go back
            // before anything is sent on another channel, which the broker does not order
            // with this one.
            Some(closed) if !self.confirms.is_empty() => {
                let error = BrokerError::Down("the channel or its connection closed".to_owned());
                self.broker_trouble("confirm", &error);
                self.link_failed(Some(closed), &error).await;
                return;
            }
            stale => {
                if let Some(stale) = stale {
                    stale.close().await;
                }
                let Some(target) = self.target.clone() else {
                    return;
                };
                let relay = &self.shared.relay;
                let policy = &config.destination_policy;
                let own_broker = target.declare.is_none();
                match Link::open(target, self.tenant, relay, policy, config.connect_timeout).await {
                    Ok(link) => {
                        self.redeclare = false;
                        if own_broker {
                            self.record_refusal(None).await;
                        }
                        link
                    }
                    Err(BrokerError::Refused(refusal)) => {
                        let error = BrokerError::Refused(refusal.clone());
                        self.broker_trouble("refused", &error);
                        self.record_refusal(Some(refusal.to_string())).await;
                        self.hold();
                        return;
                    }
                    Err(error) => {
                        self.broker_trouble("connect", &error);
                        // A tenant's broker whose certificate is refused will not be reached
                        // until the tenant fixes it: said where the tenant reads it.
                        if own_broker && error.certificate_failure().is_some() {
                            let reason = format!(
                                "the broker's TLS certificate was refused: {}",
                                error.describe()
                            );
                            self.record_refusal(Some(reason)).await;
                        }
                        self.hold();
                        return;
                    }
                }
            }
        };
        if self.redeclare {
            if let Err(error) = link.redeclare(config.connect_timeout).await {
                self.broker_trouble("connect", &error);
                link.close_after(&error, &self.shared.relay).await;
                self.hold();
                return;
            }
            self.redeclare = false;
        }
        let metrics = self.shared.metrics.clone();
        // Checked before every publish: a task that stalled past its lease (and may have a
        // successor) sends nothing more.
        while !self.held.is_lost() {
            let Some(send) = self.stream.next_to_send() else {
                break;
            };
            let (endpoint, seq) = send.change.key();
            let id = send.id;
            if send.again {
                metrics.resent.inc();
            }
            metrics.endpoint_in_flight.observe(send.in_window as f64);
            // Not awaited here: the publish and its confirm run together in `confirms`, so the
            // loop hands every change it may send over at once and goes back to taking
            // confirms. Lapin numbers a publish (for its confirm) and queues its frames on the
            // channel in the first poll of `publish`, and `confirms` first polls its futures in
            // the order they were pushed: so the publishes leave in the order they are made
            // here, an endpoint's in change_seq order.
            let publishing = publish(&link, &send.change, config.confirm_timeout);
            let published = metrics.published.clone();
            let confirm_wait = metrics.confirm_wait.clone();
            let timeout = config.confirm_timeout;
            self.confirms.push(Box::pin(async move {
                let handed = Instant::now();
                let confirm = match publishing.await {
                    Ok(confirm) => confirm,
                    Err(error) => return (endpoint, seq, id, Confirmed::NotSent(error)),
                };
                published.inc();
                let confirmed = match tokio::time::timeout(timeout, confirm).await {
                    Ok(Ok(confirmation)) => {
                        confirm_wait.observe(handed.elapsed().as_secs_f64());
                        Confirmed::Outcome(classify(confirmation))
                    }
                    Ok(Err(error)) => Confirmed::Failed(error.into()),
                    Err(_) => {
                        Confirmed::Failed(BrokerError::Timeout("waiting for the confirm", timeout))
                    }
                };
                (endpoint, seq, id, confirmed)
            }));
        }
        self.link = Some(link);
    }

    /// Books an ack of publish `id`: the changes it confirms in turn are counted and wait for
    /// their mark. An ack of a publish that was put back is ignored (its resend will come).
    /// `false` when ignored.
    fn take_acked(&mut self, endpoint: Uuid, seq: i64, id: SendId) -> bool {
        let Acked::InTurn(changes) = self.stream.acked(endpoint, seq, id, Instant::now()) else {
            return false;
        };
        let metrics = &self.shared.metrics;
        let now = OffsetDateTime::now_utc();
        for change in changes {
            let (endpoint, seq) = change.key();
            if let Some(observer) = &self.shared.config.on_confirm {
                (observer.0)(endpoint, seq);
            }
            metrics.confirmed.inc();
            let latency = (now - change.created_at).as_seconds_f64();
            metrics.latency.observe(latency.max(0.0));
        }
        true
    }

    async fn on_confirm(&mut self, endpoint: Uuid, seq: i64, id: SendId, confirmed: Confirmed) {
        let metrics = self.shared.metrics.clone();
        match confirmed {
            Confirmed::Outcome(Outcome::Confirmed) => {
                if self.take_acked(endpoint, seq, id) {
                    self.pauses = self.shared.config.retry().pauses();
                }
            }
            Confirmed::Outcome(Outcome::Returned) => {
                metrics.returned.inc();
                // The endpoint's window goes back; a return of a publish put back already
                // changes nothing more (the first one did it).
                if self.stream.refused(endpoint, seq, id).is_some() {
                    if !self.redeclare {
                        tracing::warn!(tenant = %self.tenant, %endpoint, seq,
                            "messages came back unroutable; declaring the queue (if ours) and sending again from there");
                    }
                    self.redeclare = true;
                    self.hold();
                }
            }
            Confirmed::Outcome(Outcome::Nacked) => {
                metrics.nacked.inc();
                if let Some(back) = self.stream.refused(endpoint, seq, id) {
                    tracing::warn!(tenant = %self.tenant, %endpoint, seq, back,
                                   "the broker nacked a change; sending again from there");
                    self.hold();
                }
            }
            // Whatever publish they are of (put back or not), these say the link itself is
            // not to be trusted: every publish on it is in doubt.
            Confirmed::Outcome(Outcome::Unknown) => {
                // Confirm mode is set on every channel opened here; one without it tells
                // nothing.
                let error = BrokerError::Unconfirmed(1);
                self.broker_trouble("confirm", &error);
                let link = self.link.take();
                self.link_failed(link, &error).await;
            }
            Confirmed::NotSent(error) => {
                self.broker_trouble("publish", &error);
                let link = self.link.take();
                self.link_failed(link, &error).await;
            }
            Confirmed::Failed(error) => {
                self.broker_trouble("confirm", &error);
                let link = self.link.take();
                self.link_failed(link, &error).await;
            }
        }
    }

    /// The link failed: every ack already in is taken, every confirm still to come is dropped
    /// with the link, every change sent goes back to the head of its endpoint's queue, and
    /// sending waits a pause.
    async fn link_failed(&mut self, link: Option<Link>, error: &BrokerError) {
        while let Some(Some((endpoint, seq, id, confirmed))) = self.confirms.next().now_or_never() {
            if let Confirmed::Outcome(Outcome::Confirmed) = confirmed {
                self.take_acked(endpoint, seq, id);
            }
        }
        self.confirms = FuturesUnordered::new();
        self.stream.link_lost();
        if let Some(link) = link {
            link.close_after(error, &self.shared.relay).await;
        }
        self.hold();
    }

    fn start_mark(&mut self) {
        let keys = self.stream.take_marks();
        let pool = self.shared.pool.clone();
        let (tenant, token) = (self.tenant, self.held.token());
        let hook = self.shared.config.before_mark.clone();
        self.marking = Some(Box::pin(async move {
            if let Some(hook) = hook {
                (hook.0)(keys.clone()).await;
            }
            // The statement runs in a task of its own: this future is polled only while the
            // loop waits in its `select!`, and a transaction parked with its pooled connection
            // while the loop awaits a connection for a read would hold one per tenant; with
            // more tenants than connections, every tenant's read then waits for a connection
            // that only a parked mark holds (until the pool's acquire timeout).
            let marking: Vec<(EndpointId, i64)> = keys
                .iter()
                .map(|&(endpoint, seq)| (EndpointId(endpoint), seq))
                .collect();
            let mark = tokio::spawn(async move {
                changes::mark_published(&pool, TenantId(tenant), token, &marking).await
            });
            let result = match mark.await {
                Ok(marked) => marked.map_err(OutboxError::from),
                Err(error) => Err(OutboxError::Interrupted(error.to_string())),
            };
            (keys, result)
        }));
    }

    /// `false` when another publisher fenced this one out.
    fn on_marked(&mut self, keys: Vec<(Uuid, i64)>, result: Result<Marked, OutboxError>) -> bool {
        match result {
            Ok(Marked::Marked(n)) => {
                self.shared.metrics.marked.inc_by(n);
                true
            }
            Ok(Marked::FencedOut) => {
                tracing::warn!(tenant = %self.tenant, token = self.held.token(),
                               "another publisher took the tenant over");
                false
            }
            Err(error) => {
                self.postgres_trouble("mark");
                tracing::warn!(tenant = %self.tenant, error = %error,
                               "marking confirmed changes failed; will retry");
                // Marked first, before what was confirmed since; due again once the pause ends.
                self.stream.mark_failed(keys, Instant::now());
                self.hold();
                true
            }
        }
    }

    /// Stopping: nothing more is sent; the confirms in flight are awaited (each within its
    /// timeout) and what they confirm in turn is marked.
    async fn wind_down(&mut self) -> End {
        while let Some((endpoint, seq, id, confirmed)) = self.confirms.next().await {
            match confirmed {
                Confirmed::Outcome(Outcome::Confirmed) => {
                    self.take_acked(endpoint, seq, id);
                }
                // Nothing after it of its endpoint can be confirmed in turn now.
                Confirmed::Outcome(_) | Confirmed::NotSent(_) | Confirmed::Failed(_) => {
                    let _ = self.stream.refused(endpoint, seq, id);
                }
            }
        }
        if let Some(marking) = self.marking.take() {
            let (keys, result) = marking.await;
            if !self.on_marked(keys, result) {
                return End::Fenced;
            }
        }
        if self.stream.unmarked() > 0 {
            self.start_mark();
            let (keys, result) = self.marking.take().expect("just started").await;
            if !self.on_marked(keys, result) {
                return End::Fenced;
            }
        }
        End::Shutdown
    }

    /// Starts a read of the outbox, in a task of its own beside the loop (which goes on taking
    /// confirms and sending meanwhile): on a sweep, which endpoints of the tenant have a
    /// backlog (they are read next); otherwise the next changes of the endpoints asked for.
    /// One read runs at a time, so what it is asked for (each endpoint's room, and the changes
    /// it already holds) cannot change under it except by sending, which only frees room.
    fn start_read(&mut self) {
        let pool = self.shared.pool.clone();
        let tenant = self.tenant;
        if std::mem::take(&mut self.stream.sweep) {
            let token = self.held.token();
            // In a task of its own for the reason a mark is (see `start_mark`).
            let task = tokio::spawn(async move {
                let endpoints =
                    changes::endpoints_with_backlog(&pool, TenantId(tenant), token, 1_000_000)
                        .await?;
                Ok::<_, OutboxError>(endpoints.map(|found| {
                    found
                        .into_iter()
                        .map(|(endpoint, last)| (endpoint.as_uuid(), last))
                        .collect()
                }))
            });
            self.reading = Some(Box::pin(async move {
                ReadDone::Swept(
                    task.await
                        .unwrap_or_else(|error| Err(OutboxError::Interrupted(error.to_string()))),
                )
            }));
            return;
        }
        let mut endpoints: Vec<Uuid> = self.stream.wanted.drain().collect();
        endpoints.sort_unstable();
        let limit = self.stream.limits().max_held;
        let mut asked: Vec<(Uuid, usize)> = Vec::new();
        let mut budget = limit.saturating_sub(self.stream.held());
        let mut next_read = Vec::new();
        for endpoint in endpoints {
            let room = self.stream.room(endpoint);
            if room == 0 {
                // Asked again once half its read-ahead is free (or on the next sweep).
                self.stream.capped.insert(endpoint);
                continue;
            }
            if budget == 0 {
                // The tenant's room is spoken for by this read: the next one asks.
                next_read.push(endpoint);
                continue;
            }
            let room = room.min(budget);
            budget -= room;
            asked.push((endpoint, room));
        }
        self.stream.wanted.extend(next_read);
        if asked.is_empty() {
            return;
        }
        let plans: Vec<Vec<(EndpointId, i64, i64)>> = asked
            .chunks(ENDPOINTS_PER_READ)
            .map(|chunk| {
                chunk
                    .iter()
                    .map(|(endpoint, room)| {
                        let through = self.stream.held_through(*endpoint);
                        (EndpointId(*endpoint), through, *room as i64)
                    })
                    .collect()
            })
            .collect();
        let task = tokio::spawn(async move {
            let mut read = Vec::new();
            for plan in plans {
                for row in changes::next_changes(&pool, TenantId(tenant), &plan).await? {
                    read.push(OutboxChange::from_row(tenant, row)?);
                }
            }
            Ok::<_, OutboxError>(read)
        });
        self.reading = Some(Box::pin(async move {
            let read = task
                .await
                .unwrap_or_else(|error| Err(OutboxError::Interrupted(error.to_string())));
            ReadDone::Changes(asked, read)
        }));
    }

    /// Takes in what a read found. A failed read asks for a sweep (what it was asked for is
    /// found again) after a pause. `false` when the sweep found the tenant's publishing token
    /// moved on: what this task holds of the stream may be of an epoch or a position that is no
    /// more, so it gives the tenant up (its successor starts from the publish cursors), as when
    /// a mark finds it fenced out.
    fn on_read(&mut self, done: ReadDone) -> bool {
        let failed = match done {
            ReadDone::Swept(Ok(None)) => {
                tracing::info!(tenant = %self.tenant, token = self.held.token(),
                               "the tenant's stream moved (a resync or replay) or another publisher took it over");
                return false;
            }
            ReadDone::Swept(Ok(Some(endpoints))) => {
                // Only what follows what is held: an endpoint whose changes are all sent (and
                // wait for their confirm or their mark) has nothing to read.
                let unread: Vec<Uuid> = endpoints
                    .into_iter()
                    .filter(|(endpoint, last)| *last > self.stream.held_through(*endpoint))
                    .map(|(endpoint, _)| endpoint)
                    .collect();
                self.stream.wanted.extend(unread);
                return true;
            }
            ReadDone::Changes(asked, Ok(changes)) => {
                let taken = self.stream.add_read(&asked, changes);
                self.shared
                    .metrics
                    .changes_taken
                    .with_label_values(&["outbox"])
                    .inc_by(taken);
                return true;
            }
            ReadDone::Swept(Err(error)) | ReadDone::Changes(_, Err(error)) => error,
        };
        self.stream.sweep = true;
        self.postgres_trouble("read");
        tracing::warn!(tenant = %self.tenant, error = %failed, "reading the outbox failed");
        self.hold();
        true
    }

    async fn refresh_target(&mut self) -> Result<(), relay_store::StoreError> {
        let destination = destinations::for_publishing(
            &self.shared.pool,
            &self.shared.keys,
            TenantId(self.tenant),
        )
        .await?;
        let target = Target::resolve(self.tenant, &destination, &self.shared.config.amqp_url);
        if self.target.as_ref() != Some(&target) {
            if self.target.is_some() {
                tracing::info!(tenant = %self.tenant, "the tenant's destination changed");
            }
            if let Some(link) = self.link.take() {
                link.close().await;
            }
            self.target = Some(target);
            // The control plane cleared any refusal when it stored the new destination.
            self.refusal_recorded = None;
        }
        Ok(())
    }

    /// Refreshes the tenant's backlog gauges in a task of its own (unless the last refresh
    /// still runs): a slow count must not hold up sending.
    fn refresh_backlog_metrics(&mut self) {
        if self
            .refreshing
            .as_ref()
            .is_some_and(|task| !task.is_finished())
        {
            return;
        }
        let (pool, tenant, label) = (self.shared.pool.clone(), self.tenant, self.label.clone());
        let metrics = self.shared.metrics.clone();
        self.refreshing = Some(tokio::spawn(async move {
            match changes::backlog(&pool, TenantId(tenant)).await {
                Ok((count, oldest)) => {
                    metrics.backlog.with_label_values(&[&label]).set(count);
                    let age = oldest.map_or(0.0, |t| {
                        (OffsetDateTime::now_utc() - t).as_seconds_f64().max(0.0)
                    });
                    metrics.oldest_age.with_label_values(&[&label]).set(age);
                }
                Err(error) => {
                    metrics
                        .postgres_errors
                        .with_label_values(&["backlog"])
                        .inc();
                    tracing::debug!(%tenant, error = %error, "backlog metrics not refreshed")
                }
            }
        }));
    }

    /// Tells the tenant (through its destination's row) why its destination is refused, or
    /// that it no longer is. Best effort: the refusal holds whether or not it is recorded.
    async fn record_refusal(&mut self, reason: Option<String>) {
        if self.refusal_recorded.as_ref() == Some(&reason) {
            return;
        }
        let tenant = TenantId(self.tenant);
        match destinations::record_refusal(&self.shared.pool, tenant, reason.as_deref()).await {
            Ok(()) => self.refusal_recorded = Some(reason),
            Err(error) => {
                self.postgres_trouble("destination");
                tracing::warn!(tenant = %self.tenant, error = %error,
                               "recording the destination's refusal failed");
            }
        }
    }

    fn postgres_trouble(&self, stage: &'static str) {
        self.shared
            .metrics
            .postgres_errors
            .with_label_values(&[stage])
            .inc();
    }

    fn broker_trouble(&self, stage: &'static str, error: &BrokerError) {
        self.shared
            .metrics
            .broker_errors
            .with_label_values(&[stage])
            .inc();
        let url = self
            .target
            .as_ref()
            .map(|t| crate::config::redact(t.url.expose()))
            .unwrap_or_default();
        let certificate = error.certificate_failure().map(|failure| failure.as_str());
        tracing::warn!(tenant = %self.tenant, stage, broker = %url, error = %error.describe(),
                       certificate, "broker trouble; the backlog waits in Postgres");
    }

    /// Holds sending (and the next read) for the next pause of the retry policy.
    fn hold(&mut self) {
        let wait = self.pauses.next_pause();
        let until = Instant::now() + wait;
        self.hold_until = Some(self.hold_until.map_or(until, |held| held.max(until)));
    }
}
