//! Group commit's batches: a few tasks share one queue of jobs, and each takes whatever has
//! gathered in it while it was busy, so that many callers' jobs share one transaction (or one
//! statement). While one task commits, the next batch gathers for another: batches grow with
//! load, and latency stays near one commit.
//!
//! The front tier's writers gather messages this way; the sequencer's appliers gather
//! endpoints' runs, and its readers endpoints' reads of pending messages.

use std::collections::HashSet;
use std::hash::Hash;
use std::sync::Arc;

use tokio::sync::{mpsc, Mutex};

/// How much one batch takes: at most `jobs` jobs, and no more once their weights reach
/// `weight` (the job that reaches it is taken, so a batch always has at least one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatherLimits {
    pub jobs: usize,
    pub weight: usize,
}

/// One task's batches from a queue it shares with the other tasks.
pub struct Gather<J> {
    queue: Arc<Mutex<mpsc::Receiver<J>>>,
    limits: GatherLimits,
    weight: fn(&J) -> usize,
    /// Jobs of the last batch that wait for the next (see [`Gather::next_distinct`]).
    held_back: Vec<J>,
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
        }
    }

    /// Waits for the first job, then takes whatever else is already queued, within the limits.
    /// Jobs held back from the last batch are the batch instead, without waiting. `None` once
    /// every sender is gone and the queue is empty.
    pub async fn next(&mut self) -> Option<Vec<J>> {
        if !self.held_back.is_empty() {
            return Some(std::mem::take(&mut self.held_back));
        }
        // Held while waiting for the first job: the other tasks wait their turn rather than
        // split what arrives into batches of one.
        let mut queue = self.queue.lock().await;
        let first = queue.recv().await?;
        let mut weight = (self.weight)(&first);
        let mut jobs = vec![first];
        while jobs.len() < self.limits.jobs && weight < self.limits.weight {
            let Ok(job) = queue.try_recv() else {
                break;
            };
            weight = weight.saturating_add((self.weight)(&job));
            jobs.push(job);
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
}
