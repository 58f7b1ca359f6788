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

/// Rule "Keep, with the copy, the through ...": rewind to the kept `through`, unless the last
/// message the copy took was a reset (or no message of events was ever applied): then reload.
pub fn restore_plan(track: &EndpointTrack) -> RestorePlan {
    match (&track.through, track.last_was_reset) {
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
            restore_plan(&track),
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
        assert_eq!(restore_plan(&track), RestorePlan::Reload);
        assert_eq!(restore_plan(&EndpointTrack::default()), RestorePlan::Reload);
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
