//! The tokio side of the stories upstream: one task sends every stories endpoint's webhooks
//! (several at once when the concurrency fault allows), and the workload loop.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::{JoinHandle, JoinSet};

use super::workload::StoriesWorkload;
use crate::driver::{idle_wait, Simulation};
use crate::upstream::{Answer, Outgoing};

impl Simulation {
    /// Starts the stories sender: one task for every stories endpoint, now and added later. It
    /// POSTs each due webhook in a task of its own and feeds every answer back.
    pub fn spawn_stories_sender(self: &Arc<Self>) -> JoinHandle<()> {
        let sim = self.clone();
        tokio::spawn(async move { sim.run_stories_sender().await })
    }

    async fn run_stories_sender(self: Arc<Self>) {
        let mut stop = self.stop_signal();
        let mut in_flight: JoinSet<(Outgoing, Answer)> = JoinSet::new();
        loop {
            if *stop.borrow() {
                return;
            }
            let now_ms = self.clock.now_ms();
            let (sends, next_at) = {
                let mut stories = self.stories();
                let sends = stories.poll_sends(now_ms, self.clock.wall_unix_s());
                (sends, stories.next_send_at())
            };
            for outgoing in sends {
                let sim = self.clone();
                in_flight.spawn(async move {
                    let answer = sim.post(&outgoing).await;
                    (outgoing, answer)
                });
            }
            tokio::select! {
                Some(done) = in_flight.join_next(), if !in_flight.is_empty() => {
                    if let Ok((outgoing, answer)) = done {
                        self.take_stories_answer(&outgoing, answer);
                    }
                }
                _ = tokio::time::sleep(idle_wait(now_ms, next_at)) => {}
                _ = self.wake.notified() => {}
                _ = stop.changed() => {}
            }
        }
    }

    fn take_stories_answer(&self, outgoing: &Outgoing, answer: Answer) {
        self.trace_answer(outgoing, &answer, "stories_endpoint_id");
        let now_ms = self.clock.now_ms();
        self.stories().on_answer(
            outgoing.endpoint_id,
            outgoing.serial,
            answer,
            now_ms,
            self.clock.wall_unix_s(),
        );
    }

    /// Runs the stories workload: `rate_per_s` changes a second for `duration`, then returns the
    /// number of steps.
    pub async fn run_stories_workload(
        self: Arc<Self>,
        mut workload: StoriesWorkload,
        rate_per_s: f64,
        duration: Duration,
    ) -> usize {
        self.run_steps(rate_per_s, duration, "story_change", || {
            self.change_stories(|stories, now_ms| workload.step(stories, now_ms))
        })
        .await
    }
}
