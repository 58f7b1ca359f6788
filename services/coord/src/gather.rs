//! Group commit's batches: a few tasks share one queue of jobs, and each takes whatever has
//! gathered in it while it was busy, so that many callers' jobs share one transaction (or one
//! statement). While one task commits, the next batch gathers for another: batches grow with
//! load, and latency stays near one commit.
//!
//! Taking only what has gathered leaves batches of one whenever the tasks keep up: at a modest
//! rate, or with a few callers each waiting for its answer before sending the next (the
//! upstream's senders), every job pays a transaction of its own, and a message costs several
//! times what it costs at saturation (a transaction's fixed cost, its statements' executor
//! start, its commit and its round trips, is most of a small one). So a batch may also wait a
//! little for more ([`Linger`], within a bound after its first job), guided by the queue's
//! [`Arrivals`]:
//! - while a job is known to be on its way (its sender counted it from the moment it was
//!   certain to come, a request's body read or a worker woken with messages, until it is
//!   queued), the batch waits for it;
//! - otherwise it waits only while jobs have been arriving closer together than the bound, the
//!   next is not overdue (twice the typical recent gap since the last), and such waits have been
//!   paying off: at a steady rate a batch gathers what the bound lets it; callers that all
//!   wait for their answers (a closed loop, whose next jobs come only once this batch
//!   commits) gain nothing by a wait, so after a few fruitless ones the batches stop waiting
//!   on the gaps alone, trying again only now and then.
//!
//! With the bound under the typical gap (a trickle), a job goes at once: the wait costs latency
//! only where it buys a shared commit.
//!
//! The front tier's writers gather messages this way; the sequencer's appliers gather
//! endpoints' runs, and its readers endpoints' reads of pending messages.

use std::collections::HashSet;
use std::hash::Hash;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Mutex, Notify};
use tokio::time::Instant;

/// How much one batch takes: at most `jobs` jobs, and no more once their weights reach
/// `weight` (the job that reaches it is taken, so a batch always has at least one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatherLimits {
    pub jobs: usize,
    pub weight: usize,
}

/// What is known of the jobs arriving at one queue: how many are on their way (counted by
/// [`Coming`] guards), and how far apart they have been arriving (noted by the senders with
/// [`Arrivals::sent`]).
#[derive(Debug)]
pub struct Arrivals {
    coming: AtomicUsize,
    /// Wakes a lingering batch when a job arrives or stops being on its way.
    changed: Notify,
    gaps: std::sync::Mutex<Gaps>,
    payoff: std::sync::Mutex<Payoff>,
}

/// What waiting on the gaps alone has been gaining.
#[derive(Debug, Default)]
struct Payoff {
    /// Jobs a wait gained, as a moving mean (the last waits weigh most); `None` before the
    /// first wait.
    gained: Option<f64>,
    /// Batches that did not wait since waiting last looked fruitless.
    skipped: u32,
}

/// A wait on the gaps alone is worth it while it has been gaining at least this many jobs.
const WORTH_WAITING: f64 = 0.5;
/// Once waits look fruitless, every this many batches one waits anyway, to notice that they
/// pay again.
const PROBE_EVERY: u32 = 16;

/// The recent gaps between jobs sent.
#[derive(Debug, Clone, Copy, Default)]
struct Gaps {
    last: Option<Instant>,
    /// The last [`GAPS_KEPT`] gaps, the oldest overwritten first.
    recent: [Duration; GAPS_KEPT],
    /// How many of `recent` hold a gap (up to all).
    kept: usize,
    /// Where the next gap goes.
    next: usize,
}

/// Jobs a batch stops waiting for more at: a transaction's fixed cost shared this many ways
/// is a small part of each job's.
const ENOUGH_COMPANY: usize = 16;

/// Gaps the typical one is read from.
const GAPS_KEPT: usize = 16;

impl Gaps {
    /// The median of the recent gaps: bursts of jobs with long pauses between them (callers
    /// that send together, then wait for their answers) have a short one, as a steady stream
    /// of the same rate does not. `None` before the second job.
    fn typical(&self) -> Option<Duration> {
        if self.kept == 0 {
            return None;
        }
        let mut sorted = self.recent;
        let sorted = &mut sorted[..self.kept];
        sorted.sort_unstable();
        Some(sorted[self.kept / 2])
    }
}

/// How much a wait's gain weighs in the moving mean of gains: about the last ten count.
const GAIN_WEIGHT: f64 = 0.2;

impl Default for Arrivals {
    fn default() -> Self {
        Self {
            coming: AtomicUsize::new(0),
            changed: Notify::new(),
            gaps: std::sync::Mutex::new(Gaps::default()),
            payoff: std::sync::Mutex::new(Payoff::default()),
        }
    }
}

impl Arrivals {
    /// Counts one job on its way until the returned guard is dropped: drop it once the job is
    /// queued (after [`Arrivals::sent`]) or will not be sent.
    pub fn coming(self: &Arc<Self>) -> Coming {
        self.coming.fetch_add(1, Ordering::SeqCst);
        Coming(self.clone())
    }

    /// Notes that a job was just queued.
    pub fn sent(&self) {
        let now = Instant::now();
        {
            let mut gaps = self.gaps.lock().expect("not poisoned");
            if let Some(last) = gaps.last {
                let at = gaps.next;
                gaps.recent[at] = now.saturating_duration_since(last);
                gaps.next = (at + 1) % GAPS_KEPT;
                gaps.kept = (gaps.kept + 1).min(GAPS_KEPT);
            }
            gaps.last = Some(now);
        }
        self.changed.notify_waiters();
    }

    fn coming_count(&self) -> usize {
        self.coming.load(Ordering::SeqCst)
    }

    /// Whether a batch should wait on the gaps alone: it has been gaining jobs, or it is time
    /// to try again.
    fn worth_waiting(&self) -> bool {
        let mut payoff = self.payoff.lock().expect("not poisoned");
        if payoff.gained.is_none_or(|gained| gained >= WORTH_WAITING) {
            return true;
        }
        payoff.skipped += 1;
        if payoff.skipped >= PROBE_EVERY {
            payoff.skipped = 0;
            return true;
        }
        false
    }

    /// Notes what a batch's wait on the gaps alone gained.
    fn waited(&self, gained: usize) {
        let mut payoff = self.payoff.lock().expect("not poisoned");
        let gained = gained as f64;
        payoff.gained = Some(match payoff.gained {
            None => gained,
            Some(mean) => mean * (1.0 - GAIN_WEIGHT) + gained * GAIN_WEIGHT,
        });
    }

    /// Until when a batch that may wait until `deadline` should wait for the next job, judging
    /// by the gaps alone: `None` when it should not (jobs come further apart than the bound
    /// allows, or the next is overdue: twice the typical gap since the last).
    fn next_due(&self, max: Duration, deadline: Instant) -> Option<Instant> {
        let gaps = *self.gaps.lock().expect("not poisoned");
        let (last, typical) = (gaps.last?, gaps.typical()?);
        if typical >= max {
            return None;
        }
        let overdue = last + typical * 2;
        (Instant::now() < overdue).then(|| overdue.min(deadline))
    }
}

/// One job on its way (see [`Arrivals::coming`]).
#[derive(Debug)]
pub struct Coming(Arc<Arrivals>);

impl Drop for Coming {
    fn drop(&mut self) {
        self.0.coming.fetch_sub(1, Ordering::SeqCst);
        self.0.changed.notify_waiters();
    }
}

/// How long a batch may wait for more once it holds a job: at most `max` after it, as its
/// queue's `arrivals` suggest (see the module's documentation).
#[derive(Debug, Clone)]
pub struct Linger {
    pub arrivals: Arc<Arrivals>,
    pub max: Duration,
}

/// One task's batches from a queue it shares with the other tasks.
pub struct Gather<J> {
    queue: Arc<Mutex<mpsc::Receiver<J>>>,
    limits: GatherLimits,
    weight: fn(&J) -> usize,
    /// Jobs of the last batch that wait for the next (see [`Gather::next_distinct`]).
    held_back: Vec<J>,
    linger: Option<Linger>,
}

impl<J> std::fmt::Debug for Gather<J> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gather")
            .field("limits", &self.limits)
            .field("held_back", &self.held_back.len())
            .finish_non_exhaustive()
    }
}

impl<J> Gather<J> {
    /// Batches from `queue` within `limits`, a job weighing `weight(job)`.
    pub fn new(
        queue: Arc<Mutex<mpsc::Receiver<J>>>,
        limits: GatherLimits,
        weight: fn(&J) -> usize,
    ) -> Self {
        Self {
            queue,
            limits,
            weight,
            held_back: Vec::new(),
            linger: None,
        }
    }

    /// Batches that wait for jobs on their way, as `linger` says.
    pub fn lingering(mut self, linger: Linger) -> Self {
        self.linger = Some(linger);
        self
    }

    /// Waits for the first job, then takes whatever else is already queued, within the limits,
    /// and with a [`Linger`] whatever arrives while jobs are on their way (at most its bound
    /// after the first). Jobs held back from the last batch are the batch instead, without
    /// waiting. `None` once every sender is gone and the queue is empty.
    pub async fn next(&mut self) -> Option<Vec<J>> {
        if !self.held_back.is_empty() {
            return Some(std::mem::take(&mut self.held_back));
        }
        // Held while waiting for the first job and while lingering: the other tasks wait their
        // turn rather than split what arrives into batches of one.
        let mut queue = self.queue.lock().await;
        let first = queue.recv().await?;
        let mut weight = (self.weight)(&first);
        let mut jobs = vec![first];
        let full = |jobs: &Vec<J>, weight: usize| {
            jobs.len() >= self.limits.jobs || weight >= self.limits.weight
        };
        while !full(&jobs, weight) {
            let Ok(job) = queue.try_recv() else {
                break;
            };
            weight = weight.saturating_add((self.weight)(&job));
            jobs.push(job);
        }
        let Some(linger) = &self.linger else {
            return Some(jobs);
        };
        // A job is counted before it is sent; one that woke other tasks first (its sender's
        // wake-up runs this task next) lets them run and count theirs before the count is read.
        tokio::task::yield_now().await;
        let deadline = Instant::now() + linger.max;
        // A batch this large already shares its commit widely: waiting for more would only
        // keep the other tasks from the queue.
        let full =
            |jobs: &Vec<J>, weight: usize| full(jobs, weight) || jobs.len() >= ENOUGH_COMPANY;
        // How many jobs the batch held when it began to wait on the gaps alone (`None`: it did
        // not): what it holds at the end beyond that, the wait gained.
        let mut waited_on_gaps_from: Option<usize> = None;
        while !full(&jobs, weight) {
            let changed = linger.arrivals.changed.notified();
            tokio::pin!(changed);
            // Registered before the count is read: a guard dropped after the read wakes it.
            changed.as_mut().enable();
            match queue.try_recv() {
                Ok(job) => {
                    weight = weight.saturating_add((self.weight)(&job));
                    jobs.push(job);
                    continue;
                }
                Err(mpsc::error::TryRecvError::Disconnected) => break,
                Err(mpsc::error::TryRecvError::Empty) => {}
            }
            let on_gaps = linger.arrivals.coming_count() == 0;
            let until = if on_gaps {
                match linger.arrivals.next_due(linger.max, deadline) {
                    Some(until)
                        if waited_on_gaps_from.is_some() || linger.arrivals.worth_waiting() =>
                    {
                        waited_on_gaps_from.get_or_insert(jobs.len());
                        until
                    }
                    _ => break,
                }
            } else {
                deadline
            };
            if Instant::now() >= until {
                break;
            }
            tokio::select! {
                job = queue.recv() => match job {
                    Some(job) => {
                        weight = weight.saturating_add((self.weight)(&job));
                        jobs.push(job);
                    }
                    None => break,
                },
                () = &mut changed => {}
                () = tokio::time::sleep_until(until) => {}
            }
        }
        if let Some(from) = waited_on_gaps_from {
            linger.arrivals.waited(jobs.len() - from);
        }
        Some(jobs)
    }

    /// [`Gather::next`], each `key` at most once in a batch: a job whose key is already in it is
    /// held back, in order, for the next batch (which is taken before anything new).
    pub async fn next_distinct<K: Eq + Hash>(&mut self, key: impl Fn(&J) -> K) -> Option<Vec<J>> {
        let jobs = self.next().await?;
        let mut keys = HashSet::new();
        let (batch, later) = jobs.into_iter().partition(|job| keys.insert(key(job)));
        self.held_back = later;
        Some(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A queue holding `jobs`, and its sender (dropped: the queue ends after them).
    fn queue<J>(jobs: Vec<J>) -> Arc<Mutex<mpsc::Receiver<J>>> {
        let (sender, receiver) = mpsc::channel(jobs.len().max(1));
        for job in jobs {
            sender.try_send(job).expect("room for every job");
        }
        Arc::new(Mutex::new(receiver))
    }

    const NO_WEIGHT: GatherLimits = GatherLimits {
        jobs: 3,
        weight: usize::MAX,
    };

    #[tokio::test]
    async fn a_batch_takes_what_is_queued_up_to_the_count_and_the_queue_ends_when_its_senders_do() {
        let mut gather = Gather::new(queue(vec![1, 2, 3, 4, 5]), NO_WEIGHT, |_| 1);
        assert_eq!(gather.next().await, Some(vec![1, 2, 3]));
        assert_eq!(gather.next().await, Some(vec![4, 5]));
        assert_eq!(gather.next().await, None);
    }

    #[tokio::test]
    async fn a_batch_ends_with_the_job_that_reaches_the_weight_and_a_heavy_job_goes_alone() {
        let limits = GatherLimits {
            jobs: 10,
            weight: 8,
        };
        let mut gather = Gather::new(queue(vec![4, 4, 4, 20, 1, 3]), limits, |job| *job);
        assert_eq!(gather.next().await, Some(vec![4, 4]));
        assert_eq!(gather.next().await, Some(vec![4, 20]));
        assert_eq!(gather.next().await, Some(vec![1, 3]));
        assert_eq!(gather.next().await, None);
    }

    #[tokio::test]
    async fn a_key_already_in_the_batch_waits_for_the_next_before_anything_new() {
        let limits = GatherLimits {
            jobs: 5,
            weight: usize::MAX,
        };
        let jobs = vec![('a', 1), ('b', 1), ('a', 2), ('c', 1), ('a', 3), ('d', 1)];
        let mut gather = Gather::new(queue(jobs), limits, |_| 1);
        let key = |job: &(char, u8)| job.0;
        assert_eq!(
            gather.next_distinct(key).await,
            Some(vec![('a', 1), ('b', 1), ('c', 1)])
        );
        assert_eq!(gather.next_distinct(key).await, Some(vec![('a', 2)]));
        assert_eq!(gather.next_distinct(key).await, Some(vec![('a', 3)]));
        assert_eq!(gather.next_distinct(key).await, Some(vec![('d', 1)]));
        assert_eq!(gather.next_distinct(key).await, None);
    }

    fn lingering(max: Duration) -> (Arc<Arrivals>, Linger) {
        let arrivals = Arc::new(Arrivals::default());
        let linger = Linger {
            arrivals: arrivals.clone(),
            max,
        };
        (arrivals, linger)
    }

    #[tokio::test(start_paused = true)]
    async fn with_nothing_on_its_way_a_batch_goes_at_once_however_long_it_may_linger() {
        let (_, linger) = lingering(Duration::from_secs(60));
        let mut gather = Gather::new(queue(vec![1, 2]), NO_WEIGHT, |_| 1).lingering(linger);
        let started = Instant::now();
        assert_eq!(gather.next().await, Some(vec![1, 2]));
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_waits_for_the_jobs_on_their_way_and_no_longer() {
        let (arrivals, linger) = lingering(Duration::from_millis(50));
        let (sender, receiver) = mpsc::channel(8);
        let mut gather =
            Gather::new(Arc::new(Mutex::new(receiver)), NO_WEIGHT, |_| 1).lingering(linger);
        sender.send(1).await.unwrap();
        // Two more on their way: one arrives after 3 ms, the other is given up after 5 ms.
        let (second, third) = (arrivals.coming(), arrivals.coming());
        let late = sender.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(3)).await;
            late.send(2).await.unwrap();
            drop(second);
            tokio::time::sleep(Duration::from_millis(2)).await;
            drop(third);
        });
        let started = Instant::now();
        assert_eq!(gather.next().await, Some(vec![1, 2]));
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(5),
            "ended when none was coming"
        );

        // One on its way that never comes: the batch goes at the bound.
        let _stuck = arrivals.coming();
        sender.send(3).await.unwrap();
        let started = Instant::now();
        assert_eq!(gather.next().await, Some(vec![3]));
        assert_eq!(started.elapsed(), Duration::from_millis(50));
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_batch_does_not_wait_for_more() {
        let (arrivals, linger) = lingering(Duration::from_secs(1));
        let _coming = arrivals.coming();
        let mut gather = Gather::new(queue(vec![1, 2, 3, 4]), NO_WEIGHT, |_| 1).lingering(linger);
        let started = Instant::now();
        assert_eq!(gather.next().await, Some(vec![1, 2, 3]));
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_with_enough_company_does_not_wait_for_more() {
        let limits = GatherLimits {
            jobs: 100,
            weight: usize::MAX,
        };
        let (arrivals, linger) = lingering(Duration::from_secs(1));
        let _coming = arrivals.coming();
        let queued: Vec<usize> = (0..ENOUGH_COMPANY).collect();
        let mut gather = Gather::new(queue(queued.clone()), limits, |_| 1).lingering(linger);
        let started = Instant::now();
        assert_eq!(gather.next().await, Some(queued));
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    /// Sends `job` after `after`, noting it in `arrivals` as a sender does.
    async fn send_after(sender: &mpsc::Sender<u32>, arrivals: &Arrivals, after: u64, job: u32) {
        tokio::time::sleep(Duration::from_millis(after)).await;
        sender.send(job).await.unwrap();
        arrivals.sent();
    }

    #[tokio::test(start_paused = true)]
    async fn at_a_steady_rate_a_batch_gathers_what_the_bound_lets_it_and_a_trickle_goes_alone() {
        let limits = GatherLimits {
            jobs: 100,
            weight: usize::MAX,
        };
        let (arrivals, linger) = lingering(Duration::from_millis(10));
        let (sender, receiver) = mpsc::channel(100);
        let mut gather =
            Gather::new(Arc::new(Mutex::new(receiver)), limits, |_| 1).lingering(linger);
        // Jobs every 3 ms: the first batch that knows the rate takes what comes within 10 ms.
        let steady = {
            let (sender, arrivals) = (sender.clone(), arrivals.clone());
            tokio::spawn(async move {
                for job in 0..12 {
                    send_after(&sender, &arrivals, 3, job).await;
                }
            })
        };
        assert_eq!(gather.next().await, Some(vec![0]), "no gap known yet");
        let sizes: Vec<usize> = [
            gather.next().await.unwrap().len(),
            gather.next().await.unwrap().len(),
        ]
        .into();
        assert!(sizes.iter().all(|&n| n >= 3), "batches {sizes:?}");
        steady.await.unwrap();
        while let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(1), gather.next()).await
        {
        }

        // The callers stop (a closed loop waiting for its answers): the batch goes once the
        // next is overdue, well before the bound.
        send_after(&sender, &arrivals, 3, 100).await;
        let started = Instant::now();
        assert_eq!(gather.next().await, Some(vec![100]));
        assert!(
            started.elapsed() <= Duration::from_millis(7),
            "{:?}",
            started.elapsed()
        );

        // A trickle, further apart than the bound: each job goes at once.
        for job in 200..216 {
            send_after(&sender, &arrivals, 40, job).await;
        }
        while let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(1), gather.next()).await
        {
        }
        send_after(&sender, &arrivals, 40, 300).await;
        let started = Instant::now();
        assert_eq!(gather.next().await, Some(vec![300]));
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn callers_that_wait_for_their_answers_stop_the_waits_on_gaps_after_a_few_fruitless_ones()
    {
        let limits = GatherLimits {
            jobs: 100,
            weight: usize::MAX,
        };
        let (arrivals, linger) = lingering(Duration::from_millis(10));
        let (sender, receiver) = mpsc::channel(100);
        let mut gather =
            Gather::new(Arc::new(Mutex::new(receiver)), limits, |_| 1).lingering(linger);
        // Four callers, each sending its next job only once the batch holding its last one
        // committed (2 ms).
        let mut waits = Vec::new();
        for round in 0..64u32 {
            for caller in 0..4 {
                send_after(&sender, &arrivals, 1, round * 4 + caller).await;
            }
            let started = Instant::now();
            assert_eq!(gather.next().await.map(|b| b.len()), Some(4));
            waits.push(started.elapsed() > Duration::ZERO);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let late = waits[32..].iter().filter(|&&waited| waited).count();
        assert!(waits[0], "the first batch tries: {waits:?}");
        assert!(
            late <= 3,
            "{late} of the last 32 batches still waited: {waits:?}"
        );
    }
}
