//! The open-file limit, and the bounds on connections that fit under it.
//!
//! Every connection a listener serves is a file descriptor, and so is every pooled connection to
//! Postgres, Redis or a broker, every upstream request, and each refusal being written. A bound
//! on connections above what the process may open means `accept` fails with EMFILE before the
//! bound is reached, and then everyone waits, not just the crowd. So at start-up the process
//! raises its soft limit to the hard one, and each listener's bound is cut to fit what is left
//! after the descriptors the process needs for everything else.

use crate::ListenerLimits;

/// Descriptors a listener may hold besides its connections: its own socket and the refusals it
/// writes at once ([`crate::MAX_REFUSALS_IN_FLIGHT`]).
pub const PER_LISTENER_OVERHEAD: usize = 1 + crate::MAX_REFUSALS_IN_FLIGHT;

/// Descriptors any process needs besides its listeners and pools: standard streams, the
/// runtime's own (epoll, eventfds), DNS lookups, the CA files read at start, a margin.
pub const BASE_DESCRIPTORS: usize = 64;

/// Raises the soft open-file limit to the hard one (what an unprivileged process may) and
/// returns the soft limit now in force; `None` where it cannot be read.
pub fn raise_open_file_limit() -> Option<u64> {
    // SAFETY: getrlimit and setrlimit only read and write the struct passed to them.
    unsafe {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return None;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit = raised;
            }
        }
        Some(limit.rlim_cur)
    }
}

/// How the process's descriptors were shared out, for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescriptorPlan {
    /// The soft open-file limit.
    pub open_files: u64,
    /// What the process needs besides its listeners' connections.
    pub reserved: usize,
    /// Each listener's bound on connections, as configured and as it now is.
    pub bounds: Vec<(usize, usize)>,
}

/// Cuts each listener's `max_connections` so that all of them together, their overhead and
/// `reserved` fit in `open_files`: in proportion to what each was configured with, at least one
/// each. Bounds that fit already are left as they are.
pub fn fit_connections(
    open_files: u64,
    reserved: usize,
    listeners: &mut [&mut ListenerLimits],
) -> DescriptorPlan {
    let open_files_usize = usize::try_from(open_files).unwrap_or(usize::MAX);
    let overhead = reserved + listeners.len() * PER_LISTENER_OVERHEAD;
    let room = open_files_usize.saturating_sub(overhead);
    let wanted: usize = listeners.iter().map(|l| l.max_connections).sum();
    let mut bounds = Vec::with_capacity(listeners.len());
    for limits in listeners.iter_mut() {
        let configured = limits.max_connections;
        if wanted > room {
            // u128: the product of two usizes does not overflow it.
            let share = (configured as u128 * room as u128 / wanted.max(1) as u128) as usize;
            limits.max_connections = share.max(1);
        }
        bounds.push((configured, limits.max_connections));
    }
    DescriptorPlan {
        open_files,
        reserved,
        bounds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_connections: usize) -> ListenerLimits {
        ListenerLimits {
            max_connections,
            ..ListenerLimits::METRICS
        }
    }

    #[test]
    fn bounds_that_fit_are_kept_and_the_rest_shared_in_proportion() {
        let (mut webhook, mut api, mut metrics) = (limits(4096), limits(256), limits(64));
        let plan = fit_connections(100_000, 300, &mut [&mut webhook, &mut api, &mut metrics]);
        assert_eq!(plan.bounds, vec![(4096, 4096), (256, 256), (64, 64)]);

        let plan = fit_connections(1024, 300, &mut [&mut webhook, &mut api, &mut metrics]);
        let room = 1024 - 300 - 3 * PER_LISTENER_OVERHEAD;
        let total: usize = plan.bounds.iter().map(|(_, now)| now).sum();
        assert!(total <= room, "{plan:?}");
        assert!(webhook.max_connections > api.max_connections);
        assert!(api.max_connections >= metrics.max_connections);
        assert!(metrics.max_connections >= 1);
    }

    #[test]
    fn a_limit_below_the_reserve_still_leaves_each_listener_one() {
        let mut webhook = limits(4096);
        fit_connections(100, 300, &mut [&mut webhook]);
        assert_eq!(webhook.max_connections, 1);
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let soft = raise_open_file_limit().expect("getrlimit works here");
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: as in raise_open_file_limit.
        assert_eq!(
            unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
            0
        );
        assert_eq!((soft, limit.rlim_cur), (limit.rlim_max, limit.rlim_max));
    }
}
