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
}
