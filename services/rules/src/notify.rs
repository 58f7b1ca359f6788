//! Which claimed notifications a stories endpoint sends: those of events created since the
//! endpoint was registered ([`decide_notify`] → [`NotifyDecision`]).
//!
//! A newly registered endpoint's first catch-up reads `GET /v1/events` from the start of the
//! upstream's 30-day window, and its reload in full has already saved every open story. A team
//! that signs up expects to hear of stories that become strong from then on, not of every story
//! that became strong in the month before; the stories already strong are in the copy they
//! start with. So a live `story.became_strong` created before the registration is claimed as
//! any other (the key is taken, so no later event of the story notifies) but sends nothing.
//!
//! Seed 000: "Claim before notifying", "Skip notifications for events whose origin is backfill".
//! Backfill claims nothing at all (`notification_claim`); this decision is asked only of the
//! claims a run plans (`PlannedClaim`), and never makes a second notification: the claim's
//! insert still decides, once per key, whether anything is sent.
//!
//! # How to drive it
//! `decide_stories_run` asks it for each claim it plans, given the endpoint's own `created_at`
//! (when it was registered, `StoriesRun::registered_at`), and says so in `PlannedClaim::notify`:
//! 1. [`decide_notify`] of the `created_at` of the claim's event and the registration. It calls
//!    nothing else and reads no clock.
//! 2. In the run's transaction the claim's key is inserted (`on conflict do nothing returning
//!    key`) in either case; the `notified` change is appended in the same statement only when
//!    the key came back and the decision is [`NotifyDecision::Notify`].

/// What a claim that comes back sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NotifyDecision {
    /// Claim the key and notify when the claim comes back.
    Notify,
    /// Claim the key and send nothing: the event predates the endpoint.
    ClaimSilently,
}

/// Whether a live `story.became_strong`'s claim notifies: only when the event was created at or
/// after `registered_at`, the endpoint's registration. `event_created_at` is `None` when the
/// event carried no readable `created_at`: such an event notifies, as every live
/// `story.became_strong` did before this rule, rather than a story's one notification being
/// lost on a guess.
///
/// Timestamps are compared, nothing else: the caller passes both in one type (the upstream's
/// `created_at` and the registration's, both UTC instants).
///
/// Rules: S-NOTIFY-SINCE (services/rules/RULES.md).
pub fn decide_notify<T: Ord>(event_created_at: Option<T>, registered_at: T) -> NotifyDecision {
    match event_created_at {
        Some(created_at) if created_at < registered_at => NotifyDecision::ClaimSilently,
        _ => NotifyDecision::Notify,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_created_before_the_registration_is_claimed_silently() {
        assert_eq!(decide_notify(Some(99), 100), NotifyDecision::ClaimSilently);
        assert_eq!(
            decide_notify(Some(i64::MIN), 100),
            NotifyDecision::ClaimSilently
        );
    }

    #[test]
    fn an_event_created_at_or_after_the_registration_notifies() {
        assert_eq!(decide_notify(Some(100), 100), NotifyDecision::Notify);
        assert_eq!(decide_notify(Some(101), 100), NotifyDecision::Notify);
    }

    #[test]
    fn an_event_without_a_created_at_notifies() {
        assert_eq!(decide_notify(None, 100), NotifyDecision::Notify);
    }
}
