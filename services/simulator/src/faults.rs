//! The fault knobs. Each is a probability (0 to 1) drawn from the run's seeded RNGs, so one seed
//! replays the same faults.

use std::str::FromStr;

/// What can go wrong, and how often. All zero by default: a well-behaved upstream.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Faults {
    /// After a 2xx, deliver the same message (same webhook-id and body) once more.
    pub duplicate: f64,
    /// After a 2xx, redeliver an older delivered message, after newer ones.
    pub redeliver_old: f64,
    /// After a 2xx, the upstream rewinds the track to an earlier message's `through` (new
    /// generation, no reset), as after a restore on its side.
    pub rewind: f64,
    /// An API read is slowed by `slow_read_ms`.
    pub slow_reads: f64,
    pub slow_read_ms: u64,
    /// An API read (/v1/feed, an item read) is served from a snapshot taken before recent changes,
    /// but never from before what the key's endpoints were already sent (see
    /// `Upstream::world_for_read`): the lag a receiver meets after its messages, not a promise
    /// broken.
    pub stale_reads: f64,
    /// An item read answers a load balancer's 404: plain text, no access_version.
    pub lb_404: f64,
    /// Before serving a /v1/feed page after the first, the key's access changes (and its
    /// endpoints are reset for access_changed).
    pub access_change_mid_reload: f64,
    /// Before serving a /v1/feed page after the first, the key's endpoints are sent a newer reset.
    pub reset_mid_reload: f64,
    /// The share of updates sent as a refetch instead of carrying the item.
    pub refetch: f64,
    /// A /v1/feed page after the first answers 410 `cursor_expired`: the reader must start the
    /// pass again from the first page.
    pub cursor_expired: f64,
    /// The stories upstream's faults (its webhooks and its API); named `stories_<knob>` in the
    /// text form. The feed never reads them.
    pub stories: StoriesFaults,
}

/// What can go wrong on the stories side ([`crate::stories`]). Probabilities (0 to 1) are drawn
/// from the stories upstream's seeded RNGs; durations are real milliseconds of the driver.
#[derive(Debug, Clone, PartialEq)]
pub struct StoriesFaults {
    /// After a 2xx, deliver the same webhook (same webhook-id, same body) once more, later.
    pub duplicate: f64,
    /// A webhook is held back by a random delay of up to `reorder_delay_ms` when queued, so
    /// newer ones overtake it.
    pub reorder: f64,
    pub reorder_delay_ms: u64,
    /// Webhooks of one endpoint in flight at once (1: one at a time, in order).
    pub concurrency: usize,
    /// A `story.created` webhook is held back until the story's `story.closed` webhook to the
    /// same endpoint was answered (or given up), or `late_created_max_hold_ms` passed.
    pub late_created: f64,
    pub late_created_max_hold_ms: u64,
    /// GET /v1/stories/{id} of a story changed in the last moments answers, after
    /// `stale_read_ms`, the snapshot from before that change (for a story just closed, one
    /// from before its close: a 200).
    pub stale_reads: f64,
    pub stale_read_ms: u64,
    /// GET /v1/stories/{id} answers a load balancer's 404: plain text, no JSON.
    pub lb_404: f64,
    /// A stories API read answers 503 `{"error": "unavailable"}`.
    pub server_error: f64,
}

impl Default for StoriesFaults {
    /// None: one webhook in flight at a time, in publication order.
    fn default() -> Self {
        Self {
            duplicate: 0.0,
            reorder: 0.0,
            reorder_delay_ms: 0,
            concurrency: 1,
            late_created: 0.0,
            late_created_max_hold_ms: 0,
            stale_reads: 0.0,
            stale_read_ms: 0,
            lb_404: 0.0,
            server_error: 0.0,
        }
    }
}

impl StoriesFaults {
    /// Every stories fault at a moderate rate.
    pub fn all() -> Self {
        Self {
            duplicate: 0.1,
            reorder: 0.2,
            reorder_delay_ms: 150,
            concurrency: 4,
            late_created: 0.2,
            late_created_max_hold_ms: 1_000,
            stale_reads: 0.1,
            stale_read_ms: 100,
            lb_404: 0.05,
            server_error: 0.05,
        }
    }

    /// Sets the knob `name` (without the `stories_` prefix).
    fn set(&mut self, name: &str, number: f64) -> Result<(), FaultsError> {
        let slot = match name {
            "duplicate" => &mut self.duplicate,
            "reorder" => &mut self.reorder,
            "late_created" => &mut self.late_created,
            "stale_reads" => &mut self.stale_reads,
            "lb_404" => &mut self.lb_404,
            "server_error" => &mut self.server_error,
            "reorder_delay_ms" => {
                self.reorder_delay_ms = number as u64;
                return Ok(());
            }
            "late_created_max_hold_ms" => {
                self.late_created_max_hold_ms = number as u64;
                return Ok(());
            }
            "stale_read_ms" => {
                self.stale_read_ms = number as u64;
                return Ok(());
            }
            "concurrency" => {
                self.concurrency = number as usize;
                return Ok(());
            }
            other => return Err(FaultsError::UnknownFault(format!("stories_{other}"))),
        };
        *slot = number;
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultsError {
    #[error("`{0}` is not name=probability")]
    NotAPair(String),
    #[error("no fault named `{0}`")]
    UnknownFault(String),
    #[error("`{0}` is not a number")]
    NotANumber(String),
}

impl Faults {
    /// Every fault at a moderate rate: what `--faults all` means.
    pub fn all() -> Self {
        Self {
            duplicate: 0.1,
            redeliver_old: 0.05,
            rewind: 0.02,
            slow_reads: 0.1,
            slow_read_ms: 200,
            stale_reads: 0.1,
            lb_404: 0.1,
            access_change_mid_reload: 0.05,
            reset_mid_reload: 0.05,
            refetch: 0.2,
            cursor_expired: 0.05,
            stories: StoriesFaults::all(),
        }
    }
}

impl FromStr for Faults {
    type Err = FaultsError;

    /// `none`, `all`, or comma-separated `name=value` pairs (`duplicate=0.1,slow_read_ms=50`),
    /// optionally after `all,` to change some of them.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let mut faults = Faults::default();
        for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            match entry {
                "none" => faults = Faults::default(),
                "all" => faults = Faults::all(),
                pair => {
                    let (name, value) = pair
                        .split_once('=')
                        .ok_or_else(|| FaultsError::NotAPair(pair.to_owned()))?;
                    let number: f64 = value
                        .parse()
                        .map_err(|_| FaultsError::NotANumber(value.to_owned()))?;
                    if let Some(knob) = name.strip_prefix("stories_") {
                        faults.stories.set(knob, number)?;
                        continue;
                    }
                    let slot = match name {
                        "duplicate" => &mut faults.duplicate,
                        "redeliver_old" => &mut faults.redeliver_old,
                        "rewind" => &mut faults.rewind,
                        "slow_reads" => &mut faults.slow_reads,
                        "stale_reads" => &mut faults.stale_reads,
                        "lb_404" => &mut faults.lb_404,
                        "access_change_mid_reload" => &mut faults.access_change_mid_reload,
                        "reset_mid_reload" => &mut faults.reset_mid_reload,
                        "refetch" => &mut faults.refetch,
                        "cursor_expired" => &mut faults.cursor_expired,
                        "slow_read_ms" => {
                            faults.slow_read_ms = number as u64;
                            continue;
                        }
                        other => return Err(FaultsError::UnknownFault(other.to_owned())),
                    };
                    *slot = number;
                }
            }
        }
        Ok(faults)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_presets_and_pairs() {
        assert_eq!("none".parse::<Faults>().unwrap(), Faults::default());
        let f: Faults = "all,duplicate=0.5,slow_read_ms=7".parse().unwrap();
        assert_eq!(f.duplicate, 0.5);
        assert_eq!(f.slow_read_ms, 7);
        assert_eq!(f.lb_404, Faults::all().lb_404);
        assert_eq!(
            "bogus=1".parse::<Faults>(),
            Err(FaultsError::UnknownFault("bogus".into()))
        );
    }

    #[test]
    fn parses_stories_knobs() {
        let f: Faults = "stories_duplicate=0.5,stories_concurrency=3,stories_stale_read_ms=9"
            .parse()
            .unwrap();
        assert_eq!(f.stories.duplicate, 0.5);
        assert_eq!(f.stories.concurrency, 3);
        assert_eq!(f.stories.stale_read_ms, 9);
        assert_eq!(f.duplicate, 0.0);
        assert_eq!(Faults::all().stories, StoriesFaults::all());
        assert_eq!(
            "stories_bogus=1".parse::<Faults>(),
            Err(FaultsError::UnknownFault("stories_bogus".into()))
        );
    }
}
