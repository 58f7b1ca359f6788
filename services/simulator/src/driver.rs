//! The tokio driver around the pure [`Upstream`]: it owns the clock, POSTs each message with
//! reqwest, feeds every answer back, and runs the workload at a chosen rate.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::stories::Stories;
use crate::upstream::{Answer, Outgoing, Upstream};
use crate::workload::Workload;

/// A monotonic millisecond clock from the simulation's start, and the wall clock for signing.
#[derive(Debug)]
pub struct Clock {
    start: Instant,
}

impl Clock {
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
        }
    }

    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Real Unix seconds: receivers check webhook-timestamp against their own clock.
    pub fn wall_unix_s(&self) -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0)
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

/// A running simulation: the upstream (and the stories upstream) behind a lock, the clock, and
/// the HTTP client.
#[derive(Debug)]
pub struct Simulation {
    upstream: Mutex<Upstream>,
    stories: Mutex<Stories>,
    pub clock: Clock,
    /// Woken on every change, so senders send at once instead of at their next poll.
    pub wake: Notify,
    client: reqwest::Client,
    send_timeout: Duration,
    stop_tx: watch::Sender<bool>,
    /// Print each message sent and each answer taken (the CLI's output).
    pub print_traffic: AtomicBool,
}

/// How long a sender sleeps at most before looking again, when nothing wakes it.
const IDLE_POLL: Duration = Duration::from_millis(25);

/// How long a sender with nothing to send now sleeps: until `next_at`, its next send, within
/// 1 ms and [`IDLE_POLL`].
pub(crate) fn idle_wait(now_ms: u64, next_at: Option<u64>) -> Duration {
    next_at
        .map(|at| Duration::from_millis(at.saturating_sub(now_ms)))
        .unwrap_or(IDLE_POLL)
        .clamp(Duration::from_millis(1), IDLE_POLL)
}

impl Simulation {
    /// `send_timeout`: how long to wait for an answer (the wire file's send_timeout_s, usually
    /// scaled by the time compression).
    pub fn new(upstream: Upstream, send_timeout: Duration) -> Arc<Self> {
        Self::with_stories(upstream, Stories::default(), send_timeout)
    }

    /// A simulation that plays the stories upstream too ([`crate::stories`]).
    pub fn with_stories(upstream: Upstream, stories: Stories, send_timeout: Duration) -> Arc<Self> {
        let client = reqwest::Client::builder()
            // A redirect is an answer like any other failure: never followed.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("an HTTP client without TLS builds");
        let (stop_tx, _) = watch::channel(false);
        Arc::new(Self {
            upstream: Mutex::new(upstream),
            stories: Mutex::new(stories),
            clock: Clock::new(),
            wake: Notify::new(),
            client,
            send_timeout,
            stop_tx,
            print_traffic: AtomicBool::new(false),
        })
    }

    /// The upstream. Never hold the guard across an await.
    pub fn lock(&self) -> MutexGuard<'_, Upstream> {
        self.upstream
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The stories upstream. Never hold the guard across an await.
    pub fn stories(&self) -> MutexGuard<'_, Stories> {
        self.stories
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs `change` on the stories upstream with the current time, then wakes the senders.
    pub fn change_stories<T>(&self, change: impl FnOnce(&mut Stories, u64) -> T) -> T {
        let now_ms = self.clock.now_ms();
        let result = change(&mut self.stories(), now_ms);
        self.wake.notify_waiters();
        result
    }

    /// Changes to true when the simulation shuts down.
    pub(crate) fn stop_signal(&self) -> watch::Receiver<bool> {
        self.stop_tx.subscribe()
    }

    /// Runs `change` on the upstream with the current time, then wakes the senders.
    pub fn change<T>(&self, change: impl FnOnce(&mut Upstream, u64) -> T) -> T {
        let now_ms = self.clock.now_ms();
        let result = change(&mut self.lock(), now_ms);
        self.wake.notify_waiters();
        result
    }

    /// Stops every sender and workload task.
    pub fn shutdown(&self) {
        let _ = self.stop_tx.send(true);
        self.wake.notify_waiters();
    }

    /// One sender task per endpoint the upstream has now.
    pub fn spawn_senders(self: &Arc<Self>) -> Vec<JoinHandle<()>> {
        let ids = self.lock().endpoint_ids();
        ids.into_iter().map(|id| self.spawn_sender(id)).collect()
    }

    /// A sender task for one endpoint: one message in flight, the next only after an answer.
    pub fn spawn_sender(self: &Arc<Self>, id: Uuid) -> JoinHandle<()> {
        let sim = self.clone();
        tokio::spawn(async move { sim.run_sender(id).await })
    }

    async fn run_sender(self: Arc<Self>, id: Uuid) {
        let mut stop = self.stop_tx.subscribe();
        loop {
            if *stop.borrow() {
                return;
            }
            let now_ms = self.clock.now_ms();
            let (outgoing, next_at) = {
                let mut upstream = self.lock();
                let outgoing = upstream.poll_send(id, now_ms, self.clock.wall_unix_s());
                (outgoing, upstream.next_send_at(id))
            };
            match outgoing {
                Some(outgoing) => {
                    let answer = self.post(&outgoing).await;
                    self.trace_answer(&outgoing, &answer, "webhook_endpoint_id");
                    let now_ms = self.clock.now_ms();
                    self.lock().on_answer(
                        id,
                        outgoing.serial,
                        answer,
                        now_ms,
                        self.clock.wall_unix_s(),
                    );
                }
                None => {
                    tokio::select! {
                        _ = tokio::time::sleep(idle_wait(now_ms, next_at)) => {}
                        _ = self.wake.notified() => {}
                        _ = stop.changed() => {}
                    }
                }
            }
        }
    }

    /// POSTs one message and reads how it was answered.
    pub async fn post(&self, outgoing: &Outgoing) -> Answer {
        self.trace(|| {
            // The body is the wire file's JSON; shown as such when it parses.
            let body = serde_json::from_slice::<serde_json::Value>(&outgoing.body)
                .unwrap_or_else(|_| String::from_utf8_lossy(&outgoing.body).into());
            serde_json::json!({
                "event": "send",
                "kind": outgoing.kind,
                "webhook_id": outgoing.webhook_id,
                "attempt": outgoing.attempt,
                "webhook_endpoint_id": outgoing.endpoint_id,
                "url": outgoing.url,
                "bytes": outgoing.body.len(),
                "body": body,
            })
        });
        let mut request = self
            .client
            .post(&outgoing.url)
            .timeout(self.send_timeout)
            .body(outgoing.body.to_vec());
        for (name, value) in &outgoing.headers {
            request = request.header(*name, value);
        }
        match request.send().await {
            Ok(response) => {
                let code = response.status().as_u16();
                let retry_after = response
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                Answer::Status { code, retry_after }
            }
            Err(error) => {
                tracing::debug!(%error, url = %outgoing.url, "no answer");
                Answer::NoAnswer
            }
        }
    }

    /// Runs the workload: `rate_per_s` changes a second for `duration`, then returns.
    pub async fn run_workload(
        self: Arc<Self>,
        mut workload: Workload,
        rate_per_s: f64,
        duration: Duration,
    ) -> usize {
        self.run_steps(rate_per_s, duration, "change", || {
            self.change(|upstream, now_ms| workload.step(upstream, now_ms))
        })
        .await
    }

    /// Takes `step` `rate_per_s` times a second for `duration`, or until stopped, each printed
    /// as an `event` line; how many were taken.
    pub(crate) async fn run_steps<S: serde::Serialize>(
        &self,
        rate_per_s: f64,
        duration: Duration,
        event: &str,
        mut step: impl FnMut() -> S,
    ) -> usize {
        let mut stop = self.stop_signal();
        let interval = Duration::from_secs_f64(1.0 / rate_per_s.max(0.001));
        let started = Instant::now();
        let mut steps = 0;
        while started.elapsed() < duration && !*stop.borrow() {
            let step = step();
            self.trace(|| serde_json::json!({"event": event, "step": step}));
            steps += 1;
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = stop.changed() => {}
            }
        }
        steps
    }

    /// Prints the traffic line `line()` makes, when traffic is printed.
    pub(crate) fn trace(&self, line: impl FnOnce() -> serde_json::Value) {
        if self.print_traffic.load(Ordering::Relaxed) {
            println!("{}", line());
        }
    }

    /// Traces the receiver's answer to `outgoing`, its endpoint named as `endpoint_field`.
    pub(crate) fn trace_answer(&self, outgoing: &Outgoing, answer: &Answer, endpoint_field: &str) {
        self.trace(|| {
            serde_json::json!({
                "event": "answer",
                "webhook_id": outgoing.webhook_id,
                "attempt": outgoing.attempt,
                endpoint_field: outgoing.endpoint_id,
                "answer": answer.to_json(),
            })
        });
    }

    /// Waits until every endpoint, feed and stories, has nothing left to send (or is paused):
    /// every stories webhook delivered or given up. False on timeout.
    pub async fn wait_idle(&self, timeout: Duration) -> bool {
        let started = Instant::now();
        loop {
            let idle = {
                let upstream = self.lock();
                upstream
                    .endpoint_ids()
                    .into_iter()
                    .all(|id| upstream.is_idle(id) || upstream.is_paused(id))
            } && self.stories().is_idle();
            if idle {
                return true;
            }
            if started.elapsed() >= timeout {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
