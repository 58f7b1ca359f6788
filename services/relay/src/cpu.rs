//! Where the machine's CPU went during a benchmark window, read from Linux's `/proc`.
//!
//! On this project's machines the relay, Postgres and RabbitMQ share two cores, and whether a
//! change to one of them helped shows more steadily in the CPU each message costs than in a
//! tail latency that moves with every burst of the machine. A snapshot holds the busy and total
//! jiffies of `/proc/stat` and the CPU time of every process by group; two snapshots give the
//! share of the machine that was busy and the cores each group used between them. Elsewhere
//! than Linux (no `/proc`), a snapshot is `None` and the bench reports no CPU figures.

use std::collections::BTreeMap;
use std::fs;

/// The groups processes are counted under, by their command name.
fn group_of(comm: &str) -> &'static str {
    if comm == "relay" {
        "relay"
    } else if comm.starts_with("postgres") {
        "postgres"
    } else if comm.starts_with("beam") || comm == "epmd" || comm == "erl_child_setup" {
        "rabbitmq"
    } else if comm.starts_with("redis") {
        "redis"
    } else {
        "other"
    }
}

/// The machine's and each process group's CPU time at one moment.
#[derive(Debug, Clone)]
pub struct CpuSnapshot {
    /// Jiffies of `/proc/stat`'s `cpu` line: busy (all but idle and iowait) and all.
    busy: u64,
    total: u64,
    /// Each process's user + system time, its own and its reaped children's, in jiffies.
    by_pid: BTreeMap<u32, (&'static str, u64)>,
}

/// What two snapshots say about the time between them.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CpuUsage {
    /// Share of all cores busy, in percent (100 = every core busy all the time).
    pub machine_busy_pct: f64,
    /// Cores used by each process group (1.0 = one core all the time).
    pub cores: BTreeMap<&'static str, f64>,
}

impl CpuSnapshot {
    pub fn take() -> Option<Self> {
        Self::take_scoped(&[], None)
    }

    /// As [`CpuSnapshot::take`], for one benchmark among other work on the machine: the
    /// processes `labels` names count under their label (the benchmark's own process, the build
    /// it measures), any other `relay` process as `other`; and with `database`, a Postgres
    /// backend of another database counts as `other`, and no Postgres process's reaped
    /// children count at all (the postmaster's are every database's closed connections).
    pub fn take_scoped(labels: &[(u32, &'static str)], database: Option<&str>) -> Option<Self> {
        let stat = fs::read_to_string("/proc/stat").ok()?;
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let fields: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|f| f.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal (guest times are inside user).
        let total: u64 = fields.iter().take(8).sum();
        let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
        let mut by_pid = BTreeMap::new();
        for entry in fs::read_dir("/proc").ok()?.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            // A process can end between listing and reading: skip it.
            let Ok(text) = fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            let Some((group, own, children)) = parse_process_stat(&text) else {
                continue;
            };
            let label = labels.iter().find(|(p, _)| *p == pid).map(|(_, l)| *l);
            let sample = match (label, group) {
                (Some(label), _) => (label, own + children),
                (None, "relay") if !labels.is_empty() => ("other", own + children),
                (None, "postgres") if database.is_some() => {
                    let cmdline = fs::read(entry.path().join("cmdline")).unwrap_or_default();
                    match backend_database(&String::from_utf8_lossy(&cmdline)) {
                        Some(db) if Some(db) != database => ("other", own),
                        _ => ("postgres", own),
                    }
                }
                (None, group) => (group, own + children),
            };
            by_pid.insert(pid, sample);
        }
        Some(CpuSnapshot {
            busy: total.saturating_sub(idle),
            total,
            by_pid,
        })
    }

    /// From `before` to `self`. A process that began in between counts from zero. One that
    /// ended in between counts in its parent once reaped (a Postgres backend in the
    /// postmaster's children's time), whole: what it used before `before` is counted again,
    /// which a window of tens of seconds with long-lived servers barely notices.
    pub fn since(&self, before: &CpuSnapshot) -> CpuUsage {
        let total = self.total.saturating_sub(before.total).max(1);
        let busy = self.busy.saturating_sub(before.busy);
        let cores_in_machine = cores_of_machine() as f64;
        let mut jiffies: BTreeMap<&'static str, u64> = BTreeMap::new();
        for (pid, (group, now)) in &self.by_pid {
            let then = before.by_pid.get(pid).map_or(0, |(_, t)| *t);
            *jiffies.entry(group).or_default() += now.saturating_sub(then);
        }
        // `total` counts every core's jiffies, so one core busy throughout is total / cores.
        let per_core = total as f64 / cores_in_machine;
        CpuUsage {
            machine_busy_pct: round2(100.0 * busy as f64 / total as f64),
            cores: jiffies
                .into_iter()
                .map(|(group, j)| (group, round4(j as f64 / per_core)))
                .collect(),
        }
    }
}

/// The database a Postgres backend serves, from its process title (`postgres: 15/main: <user>
/// <database> <client> <state>`); `None` for the postmaster and the server's own processes.
fn backend_database(title: &str) -> Option<&str> {
    let rest = title.strip_prefix("postgres: ")?;
    let (_cluster, rest) = rest.split_once(": ")?;
    let mut words = rest.split_whitespace();
    let _user = words.next()?;
    let database = words.next()?;
    // A backend's title goes on with its client's address (`host(port)`, or `[local]`);
    // background processes' ("walwriter", "logical replication launcher") have none.
    let client = words.next()?;
    (client.ends_with(')') || client == "[local]").then_some(database)
}

/// The command name and user + system jiffies, its own and its reaped children's, of one
/// `/proc/<pid>/stat` line.
fn parse_process_stat(text: &str) -> Option<(&'static str, u64, u64)> {
    // The command name is in parentheses and may itself hold spaces or parentheses.
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = &text[open + 1..close];
    let rest: Vec<&str> = text[close + 1..].split_whitespace().collect();
    // After the name: state (index 0), ..., utime (11), stime (12), cutime (13), cstime (14).
    let field = |i: usize| rest.get(i)?.parse::<u64>().ok();
    Some((
        group_of(comm),
        field(11)? + field(12)?,
        field(13)? + field(14)?,
    ))
}

/// The cores this process may run on (the machine's, unless it is confined).
pub fn cores_of_machine() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

/// Cores to a ten-thousandth: an idle process's share shows.
fn round4(v: f64) -> f64 {
    (v * 10_000.0).round() / 10_000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_line_gives_its_group_and_cpu_time() {
        let line = "4242 (postgres) S 1 4242 4242 0 -1 4194560 900 0 0 0 150 25 7 3 20 0 1 0";
        assert_eq!(parse_process_stat(line), Some(("postgres", 175, 10)));
        let odd = "7 (tokio (rt) x) R 1 7 7 0 -1 0 0 0 0 0 3 4 0 0 20 0 1 0";
        assert_eq!(parse_process_stat(odd), Some(("other", 7, 0)));
        assert_eq!(parse_process_stat("garbage"), None);
    }

    #[test]
    fn a_backends_title_names_its_database_and_the_servers_own_processes_none() {
        let backend = "postgres: 15/main: postgres relay_bench_path 127.0.0.1(43694) idle";
        assert_eq!(backend_database(backend), Some("relay_bench_path"));
        assert_eq!(backend_database("postgres: 15/main: walwriter "), None);
        assert_eq!(
            backend_database("postgres: 15/main: logical replication launcher "),
            None
        );
        assert_eq!(
            backend_database("/usr/lib/postgresql/15/bin/postgres -D /var/lib/postgresql"),
            None
        );
    }

    #[test]
    fn two_snapshots_give_busy_share_and_cores_per_group() {
        let before = CpuSnapshot {
            busy: 100,
            total: 400,
            by_pid: BTreeMap::from([(1, ("relay", 10)), (2, ("postgres", 50))]),
        };
        let after = CpuSnapshot {
            busy: 300,
            total: 800,
            by_pid: BTreeMap::from([
                (1, ("relay", 60)),
                (2, ("postgres", 150)),
                (3, ("postgres", 20)),
            ]),
        };
        let usage = after.since(&before);
        assert_eq!(usage.machine_busy_pct, 50.0);
        let per_core = 400.0 / cores_of_machine() as f64;
        assert_eq!(usage.cores["relay"], round4(50.0 / per_core));
        assert_eq!(usage.cores["postgres"], round4(120.0 / per_core));
    }

    #[test]
    fn this_machine_can_be_read_where_it_is_linux() {
        if cfg!(target_os = "linux") {
            let first = CpuSnapshot::take().expect("/proc is readable");
            let second = CpuSnapshot::take().expect("/proc is readable");
            let usage = second.since(&first);
            assert!((0.0..=100.0).contains(&usage.machine_busy_pct));
        }
    }
}
