//! The one retry policy for calls to the upstream and to brokers: pauses that grow from `first`
//! to `max`, each with jitter (backon's: up to as much again, at random), so endpoints or
//! tenants that failed together do not all retry together.

use std::time::Duration;

use backon::BackoffBuilder as _;

/// How long to wait between tries of a failing call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The pause after the first failure (before jitter).
    pub first: Duration,
    /// The longest pause (before jitter).
    pub max: Duration,
}

impl RetryPolicy {
    /// The pauses to take, one per failure, for as long as the caller keeps trying: `first`,
    /// doubling up to `max`, each plus a random part of itself.
    pub fn pauses(&self) -> Pauses {
        Pauses(
            backon::ExponentialBuilder::new()
                .with_min_delay(self.first)
                .with_max_delay(self.max)
                .with_factor(2.0)
                .with_jitter()
                .without_max_times()
                .build(),
        )
    }
}

/// An endless run of pauses (see [`RetryPolicy::pauses`]). Start a new one after a success.
pub struct Pauses(backon::ExponentialBackoff);

impl Iterator for Pauses {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        self.0.next()
    }
}

impl Pauses {
    /// The next pause (the run never ends).
    pub fn next_pause(&mut self) -> Duration {
        self.next().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_grow_to_the_cap_with_jitter_and_never_end() {
        let policy = RetryPolicy {
            first: Duration::from_millis(100),
            max: Duration::from_secs(2),
        };
        let pauses: Vec<Duration> = policy.pauses().take(50).collect();
        assert_eq!(pauses.len(), 50);
        for (i, pause) in pauses.iter().enumerate() {
            let base = (policy.first * 2u32.pow(i.min(10) as u32)).min(policy.max);
            // backon computes in f32: allow it a millisecond either side.
            let slack = Duration::from_millis(1);
            assert!(
                *pause + slack >= base && *pause <= base * 2 + slack,
                "pause {i}: {pause:?} against {base:?}"
            );
        }
        // Two runs of the same policy do not move in lock-step.
        let again: Vec<Duration> = policy.pauses().take(50).collect();
        assert_ne!(pauses, again);
    }
}
