//! Stored messages that cannot be applied: tried again a bounded number of times, with jittered
//! exponential backoff, then quarantined, and the copy read again without them.
//!
//! The signature proves a stored message came from the upstream, so it is kept whatever it
//! holds; but a message that can never be applied (its body is not a v1 message, or applying it
//! keeps failing) must not hold back every message after it. Quarantining it moves the apply
//! cursor past it, and rule "read /v1/feed again" (a reload, or another pass of the running one:
//! [`EndpointTrack::read_feed_again`]) brings the copy to what the upstream holds, whatever that message would have changed: the
//! copy still converges, and the message stays kept, with its reason, for the tenant to retry or
//! discard.

use std::time::Duration;

use crate::track::{EndpointTrack, MessageDecision};

/// Why a stored message cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unapplicable {
    /// The body does not parse as a v1 message (the parse error).
    #[error("not a v1 message: {0}")]
    NotV1(String),
    /// A message of the feed track that carries no generation.
    #[error("a message of the feed track carries no generation")]
    MissingGeneration,
    /// Applying it failed `attempts` times; `error` is the last failure.
    #[error("applying it failed {attempts} times; last: {error}")]
    KeepsFailing { attempts: u32, error: String },
}

/// Quarantines a message that cannot be applied, and reads `/v1/feed` again: the message's
/// changes (whatever they were) reach the copy by the reload, so the copy converges without it.
/// A reload already running is asked to read another pass after its current one (see
/// [`EndpointTrack::read_feed_again`]): its pages may predate the message.
pub fn quarantine(state: &EndpointTrack, why: Unapplicable) -> (EndpointTrack, MessageDecision) {
    let (next, reload) = state.read_feed_again();
    (next, MessageDecision::Quarantine { why, reload })
}

/// How long to wait before trying a failed apply again: a ceiling of `first` doubling with each
/// failure, up to `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApplyBackoff {
    pub first: Duration,
    pub max: Duration,
}

/// What to do after a message failed to apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailedApply {
    /// Try it again after this long (the endpoint's later messages wait behind it).
    RetryAfter(Duration),
    /// Tried enough: quarantine it ([`quarantine`] with [`Unapplicable::KeepsFailing`]).
    Quarantine,
}

/// The decision after the `attempts`-th failed apply of one message (counting from 1), with at
/// most `max_attempts` tries in all. `jitter` is a random number in `[0, 1)` the caller draws:
/// the wait is half the ceiling plus up to half again ("equal jitter"), so endpoints that failed
/// together do not retry together, and no retry comes sooner than half the ceiling.
pub fn decide_failed_apply(
    attempts: u32,
    max_attempts: u32,
    backoff: ApplyBackoff,
    jitter: f64,
) -> FailedApply {
    if attempts >= max_attempts.max(1) {
        return FailedApply::Quarantine;
    }
    let doublings = attempts.saturating_sub(1).min(31);
    let ceiling = backoff
        .first
        .saturating_mul(1u32 << doublings)
        .min(backoff.max);
    let jitter = if jitter.is_finite() {
        jitter.clamp(0.0, 1.0)
    } else {
        0.0
    };
    FailedApply::RetryAfter(ceiling / 2 + ceiling.mul_f64(jitter) / 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::track::{Reload, ReloadCause, ReloadStart};
    use proptest::prelude::*;

    fn reload_of(decision: &MessageDecision) -> Option<&ReloadStart> {
        match decision {
            MessageDecision::Quarantine { reload, .. } => Some(reload),
            _ => None,
        }
    }

    const BACKOFF: ApplyBackoff = ApplyBackoff {
        first: Duration::from_millis(100),
        max: Duration::from_secs(10),
    };

    #[test]
    fn a_message_that_cannot_be_applied_is_quarantined_and_the_feed_read_again() {
        let held = EndpointTrack {
            generation: Some(4),
            access_version: Some("av".into()),
            ..EndpointTrack::default()
        };
        let (next, decision) = quarantine(&held, Unapplicable::NotV1("expected value".into()));
        let begun = Reload {
            generation: 4,
            access_version: None,
            cause: ReloadCause::ReadAgain,
            read_again: 0,
            round: 1,
        };
        assert_eq!(
            decision,
            MessageDecision::Quarantine {
                why: Unapplicable::NotV1("expected value".into()),
                reload: ReloadStart::Begin(begun.clone()),
            }
        );
        assert_eq!(next.reload, Some(begun));
        // The copy stays held under its access_version until the reload's pages say otherwise.
        assert_eq!(next.access_version.as_deref(), Some("av"));
        assert_eq!(next.generation, Some(4));
    }

    #[test]
    fn a_quarantine_during_a_reload_asks_that_reload_to_read_again() {
        let running = Reload {
            generation: 6,
            access_version: Some("av2".into()),
            cause: ReloadCause::AccessVersion,
            read_again: 0,
            round: 1,
        };
        let held = EndpointTrack {
            generation: Some(6),
            reload: Some(running.clone()),
            ..EndpointTrack::default()
        };
        let (next, decision) = quarantine(&held, Unapplicable::MissingGeneration);
        let again = Reload {
            read_again: 1,
            ..running.clone()
        };
        assert_eq!(
            reload_of(&decision),
            Some(&ReloadStart::ReadAgain(again.clone()))
        );
        assert!(again.is(&running));
        assert_eq!(next.reload, Some(again));
    }

    #[test]
    fn failed_applies_are_retried_with_growing_waits_then_quarantined() {
        let wait = |attempts| match decide_failed_apply(attempts, 5, BACKOFF, 0.0) {
            FailedApply::RetryAfter(wait) => wait,
            FailedApply::Quarantine => panic!("attempt {attempts} quarantined"),
        };
        assert_eq!(wait(1), Duration::from_millis(50));
        assert_eq!(wait(2), Duration::from_millis(100));
        assert_eq!(wait(4), Duration::from_millis(400));
        assert_eq!(
            decide_failed_apply(5, 5, BACKOFF, 0.5),
            FailedApply::Quarantine
        );
        assert_eq!(
            decide_failed_apply(1, 0, BACKOFF, 0.5),
            FailedApply::Quarantine,
            "at least one try"
        );
    }

    proptest! {
        #[test]
        fn a_wait_lies_between_half_its_ceiling_and_the_ceiling_and_never_past_the_max(
            attempts in 1u32..200,
            max_attempts in 1u32..200,
            jitter in proptest::num::f64::ANY,
        ) {
            match decide_failed_apply(attempts, max_attempts, BACKOFF, jitter) {
                FailedApply::Quarantine => prop_assert!(attempts >= max_attempts),
                FailedApply::RetryAfter(wait) => {
                    prop_assert!(attempts < max_attempts);
                    let ceiling = BACKOFF
                        .first
                        .saturating_mul(1u32 << (attempts - 1).min(31))
                        .min(BACKOFF.max);
                    prop_assert!(wait >= ceiling / 2, "{wait:?} under half of {ceiling:?}");
                    prop_assert!(wait <= ceiling, "{wait:?} over {ceiling:?}");
                }
            }
        }

        #[test]
        fn every_try_until_the_last_waits_and_the_last_quarantines(max_attempts in 1u32..50) {
            let decisions: Vec<FailedApply> = (1..=max_attempts)
                .map(|a| decide_failed_apply(a, max_attempts, BACKOFF, 0.5))
                .collect();
            let (last, before) = decisions.split_last().unwrap();
            prop_assert_eq!(last, &FailedApply::Quarantine);
            prop_assert!(before.iter().all(|d| matches!(d, FailedApply::RetryAfter(_))));
        }

        #[test]
        fn quarantine_always_leaves_a_reload_running_and_keeps_the_generation(
            generation in proptest::option::of(0u64..1000),
            running in proptest::option::of((0u64..1000, 0u32..5)),
        ) {
            let held = EndpointTrack {
                generation,
                reload: running.map(|(g, n)| Reload {
                    generation: g,
                    access_version: None,
                    cause: ReloadCause::ReadAgain,
                    read_again: n,
                    round: 0,
                }),
                ..EndpointTrack::default()
            };
            let (next, decision) = quarantine(&held, Unapplicable::MissingGeneration);
            prop_assert!(next.reload.is_some());
            prop_assert_eq!(next.generation, held.generation);
            let reload = reload_of(&decision).expect("a quarantine begins a reload");
            let begun = match reload {
                ReloadStart::Begin(r) | ReloadStart::ReadAgain(r) => r,
                ReloadStart::Supersede { begun, .. } => begun,
            };
            prop_assert_eq!(Some(begun), next.reload.as_ref());
        }
    }
}
