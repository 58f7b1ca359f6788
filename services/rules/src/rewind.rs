//! After the copy is restored from a backup: rewind the track, or read `/v1/feed` again.
//!
//! Rule "Keep, with the copy, the through of the last message of events applied on each track":
//! after restoring, rewind the track to it, or, when the last message the copy took was a reset,
//! read `/v1/feed` again. A rewind refused `before_reset` or `cursor_not_in_epoch` means read
//! `/v1/feed` again; one refused `cursor_ahead` or `reset_pending` needs nothing.

use crate::track::EndpointTrack;

/// What to do for a track of a copy just restored from a backup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestorePlan {
    /// `POST .../tracks/{track}/rewind` with `{"since": since}`.
    Rewind { since: String },
    /// Read `/v1/feed` again (the last message taken was a reset, or none of events was).
    Reload,
}

/// A restore the relay was told of (`relay restored`): what the backup kept of the track, held
/// until the track's rewind is answered. Messages taken after the restart move the track's own
/// `through` (and clear `last_was_reset`); planning the rewind from those would start it past
/// what the old relay applied after the backup, which would then never come again.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PendingRestore {
    /// The `through` of the last message of events the backup applied.
    pub through: Option<String>,
    /// Whether the last message the backup took was a reset.
    pub last_was_reset: bool,
}

/// Rule "Keep, with the copy, the through ...": rewind to the kept `through`, unless the last
/// message the copy took was a reset (or no message of events was ever applied): then reload.
/// What "kept" means is the backup's, held by `pending` when the relay was told of the restore;
/// without it (a restore nobody marked), the track's own.
pub fn restore_plan(track: &EndpointTrack, pending: Option<&PendingRestore>) -> RestorePlan {
    let (through, last_was_reset) = match pending {
        Some(held) => (&held.through, held.last_was_reset),
        None => (&track.through, track.last_was_reset),
    };
    match (through, last_was_reset) {
        (Some(since), false) => RestorePlan::Rewind {
            since: since.clone(),
        },
        _ => RestorePlan::Reload,
    }
}

/// The rewind's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RewindAnswer {
    /// `202`: the track resends from `since` under this generation (no reset is sent).
    Accepted { generation: u64 },
    /// `409` with its `error`.
    Refused(RewindRefusal),
}

/// A `409`'s `error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RewindRefusal {
    BeforeReset,
    CursorNotInEpoch,
    CursorAhead,
    ResetPending,
    /// A refusal version 1 does not name.
    Other(String),
}

impl RewindRefusal {
    pub fn parse(error: &str) -> Self {
        match error {
            "before_reset" => Self::BeforeReset,
            "cursor_not_in_epoch" => Self::CursorNotInEpoch,
            "cursor_ahead" => Self::CursorAhead,
            "reset_pending" => Self::ResetPending,
            other => Self::Other(other.to_owned()),
        }
    }
}

/// What a rewind's answer asks of the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RewindOutcome {
    /// The messages that follow bring the copy up to date.
    Nothing,
    /// Read `/v1/feed` again.
    Reload,
}

/// Rule "Keep, with the copy, the through ...": accepted, or refused `cursor_ahead` (the
/// messages that follow overlap the copy) or `reset_pending` (the reset that follows reads
/// everything again): nothing. Refused `before_reset` (the backup is no newer than the last
/// reset) or `cursor_not_in_epoch` (older than a restore of the feed): reload. A refusal version
/// 1 does not name is taken as the safe one: reload.
///
/// Rules: R-THROUGH (services/rules/RULES.md).
pub fn decide_rewind(answer: &RewindAnswer) -> RewindOutcome {
    match answer {
        RewindAnswer::Accepted { .. } => RewindOutcome::Nothing,
        RewindAnswer::Refused(RewindRefusal::CursorAhead | RewindRefusal::ResetPending) => {
            RewindOutcome::Nothing
        }
        RewindAnswer::Refused(
            RewindRefusal::BeforeReset | RewindRefusal::CursorNotInEpoch | RewindRefusal::Other(_),
        ) => RewindOutcome::Reload,
    }
}

/// Rule "... means: read /v1/feed again", as the control plane carries it out after a restore:
/// the track row with a reload begun under the held generation
/// ([`EndpointTrack::read_feed_again`]), or `None` when a reload runs already (it reads
/// everything again; a restore names no change that its pass could have missed).
pub fn reload_after_restore(track: &EndpointTrack) -> Option<EndpointTrack> {
    track.reload.is_none().then(|| track.read_feed_again().0)
}

/// What the relay does once a restored track's plan is answered ([`answer_rewind`]), in one
/// transaction under the track row's lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RewindAnswered {
    pub outcome: RewindOutcome,
    /// The track row to write, when it changes: a reload begun, or the generation raised to an
    /// accepted rewind's.
    pub track: Option<EndpointTrack>,
    /// Let go of the [`PendingRestore`] and forget the event ids applied since the restore.
    ///
    /// Why forget them: a message taken between the restart and the rewind applied its events
    /// under the generation then; the rewind resends them (they follow the backup's `through`)
    /// under a newer one, together with the events the backup missed. An older event of the same
    /// subject resent that way wins over what the early message wrote (a newer generation wins
    /// whatever its sequence), and the early message's own event, resent, would be dropped as
    /// applied: the copy would end on the older one. Forgotten, it applies again after it, as
    /// the upstream orders them. Forgetting an id never makes a copy wrong (every write is
    /// conditional on position); at worst an event is decided twice.
    pub release_restore: bool,
}

/// Rule "Keep, with the copy, the through ...", after the plan's answer: `answer` is the
/// rewind's, or `None` when the plan was to read `/v1/feed` again without asking. `pending`:
/// whether the plan was made from a [`PendingRestore`].
///
/// - Read `/v1/feed` again ([`decide_rewind`]): a reload begun ([`reload_after_restore`]).
/// - Accepted under generation `G`: the held generation rises to `G` at once. The upstream
///   resends everything after `since` under `G`, so a message of an older generation still in
///   flight is one the rewind sends again, and is skipped as older (rule "Ignore a message of an
///   older generation than the one held") rather than applied after the ids are forgotten.
/// - Refused `cursor_ahead` or `reset_pending`: the track as it is.
pub fn answer_rewind(
    track: &EndpointTrack,
    answer: Option<&RewindAnswer>,
    pending: bool,
) -> RewindAnswered {
    let outcome = answer.map_or(RewindOutcome::Reload, decide_rewind);
    let next = match (outcome, answer) {
        (RewindOutcome::Reload, _) => reload_after_restore(track),
        (RewindOutcome::Nothing, Some(RewindAnswer::Accepted { generation }))
            if track.generation.is_none_or(|held| held < *generation) =>
        {
            Some(EndpointTrack {
                generation: Some(*generation),
                ..track.clone()
            })
        }
        (RewindOutcome::Nothing, _) => None,
    };
    RewindAnswered {
        outcome,
        track: next,
        release_restore: pending,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn through_rule_restore_rewinds_to_the_kept_through() {
        let track = EndpointTrack {
            through: Some("1.1050".into()),
            ..Default::default()
        };
        assert_eq!(
            restore_plan(&track, None),
            RestorePlan::Rewind {
                since: "1.1050".into()
            }
        );
    }

    #[test]
    fn through_rule_restore_after_a_reset_reloads() {
        let track = EndpointTrack {
            through: Some("1.1050".into()),
            last_was_reset: true,
            ..Default::default()
        };
        assert_eq!(restore_plan(&track, None), RestorePlan::Reload);
        assert_eq!(
            restore_plan(&EndpointTrack::default(), None),
            RestorePlan::Reload
        );
    }

    #[test]
    fn through_rule_a_held_restore_plans_from_the_backup_whatever_came_since() {
        // A message taken after the restart moved the track past the backup's through, and
        // cleared its last_was_reset.
        let track = EndpointTrack {
            generation: Some(3),
            through: Some("1.1029".into()),
            ..Default::default()
        };
        let held = PendingRestore {
            through: Some("1.1021".into()),
            last_was_reset: false,
        };
        assert_eq!(
            restore_plan(&track, Some(&held)),
            RestorePlan::Rewind {
                since: "1.1021".into()
            }
        );
        let after_reset = PendingRestore {
            last_was_reset: true,
            ..held
        };
        assert_eq!(
            restore_plan(&track, Some(&after_reset)),
            RestorePlan::Reload
        );
        let nothing_applied = PendingRestore::default();
        assert_eq!(
            restore_plan(&track, Some(&nothing_applied)),
            RestorePlan::Reload
        );
    }

    #[test]
    fn through_rule_an_accepted_rewind_raises_the_held_generation_and_releases_the_restore() {
        let track = EndpointTrack {
            generation: Some(3),
            through: Some("1.1029".into()),
            ..Default::default()
        };
        let answered = answer_rewind(
            &track,
            Some(&RewindAnswer::Accepted { generation: 4 }),
            true,
        );
        assert_eq!(answered.outcome, RewindOutcome::Nothing);
        assert!(answered.release_restore);
        let next = answered.track.expect("the generation rises");
        assert_eq!(next.generation, Some(4));
        assert_eq!(next.through, track.through);
        assert_eq!(next.reload, None);

        // Already there (a message of the rewind came first): nothing to write.
        let there = EndpointTrack {
            generation: Some(4),
            ..track.clone()
        };
        let answered = answer_rewind(
            &there,
            Some(&RewindAnswer::Accepted { generation: 4 }),
            false,
        );
        assert_eq!((answered.track, answered.release_restore), (None, false));
    }

    #[test]
    fn through_rule_refusals_and_no_call_after_a_restore() {
        let track = EndpointTrack {
            generation: Some(3),
            reloads_begun: 1,
            ..Default::default()
        };
        let refused = |e: &str| {
            answer_rewind(
                &track,
                Some(&RewindAnswer::Refused(RewindRefusal::parse(e))),
                true,
            )
        };
        for nothing in ["cursor_ahead", "reset_pending"] {
            let answered = refused(nothing);
            assert_eq!(answered.outcome, RewindOutcome::Nothing, "{nothing}");
            assert_eq!(answered.track, None, "{nothing}");
            assert!(answered.release_restore, "{nothing}");
        }
        for reload in ["before_reset", "cursor_not_in_epoch"] {
            let answered = refused(reload);
            assert_eq!(answered.outcome, RewindOutcome::Reload, "{reload}");
            let reload = answered.track.and_then(|t| t.reload).expect("a reload");
            assert_eq!((reload.generation, reload.round), (3, 2));
        }
        let answered = answer_rewind(&track, None, true);
        assert_eq!(answered.outcome, RewindOutcome::Reload);
        assert!(answered.track.is_some_and(|t| t.reload.is_some()));
    }

    #[test]
    fn through_rule_restore_reload_is_begun_once() {
        let held = EndpointTrack {
            generation: Some(3),
            reloads_begun: 4,
            ..Default::default()
        };
        let begun = reload_after_restore(&held).expect("no reload ran: one begins");
        let reload = begun.reload.clone().expect("a reload");
        assert_eq!((reload.generation, reload.round), (3, 5));
        assert_eq!(reload_after_restore(&begun), None);
    }

    #[test]
    fn through_rule_rewind_answers() {
        use RewindOutcome::*;
        let refused = |e: &str| decide_rewind(&RewindAnswer::Refused(RewindRefusal::parse(e)));
        assert_eq!(
            decide_rewind(&RewindAnswer::Accepted { generation: 5 }),
            Nothing
        );
        assert_eq!(refused("before_reset"), Reload);
        assert_eq!(refused("cursor_not_in_epoch"), Reload);
        assert_eq!(refused("cursor_ahead"), Nothing);
        assert_eq!(refused("reset_pending"), Nothing);
        assert_eq!(refused("something_new"), Reload);
    }
}
