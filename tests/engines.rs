//! Real engines started privately on this machine for fault-injection campaigns (Jepsen
//! style): a three-node RabbitMQ cluster, a PostgreSQL primary with a synchronous streaming
//! standby, and a Redis server.
//!
//! Each engine runs on ports and in a temporary directory of its own, apart from the machine's
//! default services (Postgres 5432, Redis 6379, RabbitMQ 5672/15672/25672), which are never
//! touched. Every engine is cleaned up when dropped, also when a test panics: its processes are
//! killed (the whole process tree, checked gone) and its directory removed.
//!
//! Why the processes are started the way they are:
//! - Every server is a direct child of one long-lived "spawner" thread, in a process group of
//!   its own, with `PR_SET_PDEATHSIG = SIGKILL`: if the test process dies without dropping the
//!   harness (killed by a timeout, Ctrl-C), the kernel kills the servers too instead of leaving
//!   orphans that hold ports. The signal fires when the *thread* that forked the child ends,
//!   hence a thread that lives as long as the process (not a tokio worker or blocking thread).
//! - The server's own binary is the child (no wrapper shell, no `runuser`), so the pid the
//!   harness holds is the pid it kills: `beam.smp` for RabbitMQ, the postmaster for Postgres.
//! - Ports are claimed, not just found free: [`claim_port`] picks a port below the kernel's
//!   ephemeral range (so no outgoing connection can borrow it while a killed server is down,
//!   and a restart on the same port does not race the kernel) and holds an abstract Unix
//!   socket named after it for the engine's life, so another process running this harness at
//!   once never takes the same port. The kernel drops the claim when the process dies: there is
//!   no lock file to go stale.
//! - Slow commands (`initdb`, `pg_basebackup`, `rabbitmqctl`...) run on `tokio::process` with a
//!   bound; every wait has a bound and an error naming what did not happen, with the tail of
//!   the engine's log.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::future::Future;
use std::io::{self, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpListener as StdTcpListener, TcpStream as StdTcpStream};
use std::os::linux::net::SocketAddrExt as _;
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use serde_json::Value;
use sqlx::Connection as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";
// The scripts themselves, not the /usr/sbin wrappers: those `su` to the rabbitmq user when run
// as root, which would put a shell between us and beam.smp and use that user's cookie.
const RABBITMQ_SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";
const RABBITMQCTL: &str = "/usr/lib/rabbitmq/bin/rabbitmqctl";
const REDIS_SERVER: &str = "/usr/bin/redis-server";

/// The RabbitMQ nodes of a [`RabbitCluster`].
const RABBIT_NODES: usize = 3;

// ---- ports, names, directories ---------------------------------------------------------------

/// A port free right now: binds 127.0.0.1:0 and returns what the kernel chose. Nothing holds it
/// afterwards; the engines use [`claim_port`] instead, which does.
pub fn free_port() -> u16 {
    StdTcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .expect("binding 127.0.0.1:0")
        .port()
}

/// A TCP port held for this process until dropped (see [`claim_port`]).
#[derive(Debug)]
pub struct PortClaim {
    port: u16,
    // Bound to an abstract name derived from the port: the claim itself.
    _claim: UnixListener,
}

impl PortClaim {
    pub fn port(&self) -> u16 {
        self.port
    }
}

/// A port no other process running this harness can claim while the result lives, free on
/// 127.0.0.1 when claimed, below the kernel's ephemeral range when there is room there.
pub fn claim_port() -> anyhow::Result<PortClaim> {
    // Ports that well-known services on this kind of machine use, even when stopped.
    const RESERVED: &[u16] = &[25672, 27017, 27018, 27019];
    let ephemeral_low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let below = (ephemeral_low > 21_000).then_some(20_000..ephemeral_low);
    for _ in 0..2_000 {
        let port = match &below {
            Some(range) => rand::random::<u16>() % (range.end - range.start) + range.start,
            None => free_port(),
        };
        if RESERVED.contains(&port) {
            continue;
        }
        let name = format!("relay-engines-port-{port}");
        let addr = UnixAddr::from_abstract_name(name.as_bytes())?;
        let Ok(claim) = UnixListener::bind_addr(&addr) else {
            continue; // Another harness holds it.
        };
        if StdTcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_err() {
            continue; // Something else listens there.
        }
        return Ok(PortClaim {
            port,
            _claim: claim,
        });
    }
    bail!("no free port could be claimed in 2000 tries")
}

/// `kind-pid-counter-random`: unique among processes running now (pid), within this process
/// (counter), and against a dead process whose pid came back (random).
fn unique_name(kind: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let salt = rand::random::<u32>() & 0xff_ffff;
    format!("{kind}-{}-{n}-{salt:06x}", std::process::id())
}

/// A directory under the temp dir, removed (with everything in it) when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(kind: &str) -> anyhow::Result<Self> {
        sweep_stale_dirs();
        let path = std::env::temp_dir().join(format!("relay-engines-{}", unique_name(kind)));
        // `create_dir`, not `create_dir_all`: fails rather than share a directory.
        fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        // 0755: the postgres user must reach its data directories inside.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755))?;
        Ok(Self(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.0) {
            if e.kind() != io::ErrorKind::NotFound {
                eprintln!("engines: could not remove {}: {e}", self.0.display());
            }
        }
    }
}

/// Removes, once per process, what harness processes that died without dropping their engines
/// (SIGKILL) left: their servers died with them (see [`spawn_owned`]), their directories and
/// Postgres' System V segments did not. A directory whose pid (in its name) is alive is left
/// alone.
fn sweep_stale_dirs() {
    static SWEPT: OnceLock<()> = OnceLock::new();
    SWEPT.get_or_init(|| {
        let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix("relay-engines-")) else {
                continue;
            };
            // kind-pid-counter-salt
            let Some(Ok(pid)) = rest.split('-').nth(1).map(str::parse::<i32>) else {
                continue;
            };
            if pid > 0 && !pid_alive(pid) {
                // Its postmasters' System V segments outlive them too (named in the data dirs).
                for data in fs::read_dir(entry.path()).into_iter().flatten().flatten() {
                    remove_pg_sysv_segment(&data.path());
                }
                let _ = fs::remove_dir_all(entry.path());
            }
        }
    });
}

/// The last `lines` lines of a log, for an error message.
fn log_tail(path: &Path, lines: usize) -> String {
    match fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().collect();
            let from = all.len().saturating_sub(lines);
            format!("--- {} ---\n{}", path.display(), all[from..].join("\n"))
        }
        Err(e) => format!("--- {}: {e}", path.display()),
    }
}

fn append_file(path: &Path) -> io::Result<fs::File> {
    fs::OpenOptions::new().create(true).append(true).open(path)
}

/// Environment variables of the test process that would steer an engine or its tools away
/// from what the harness set (a `PGPORT`, an `ERL_FLAGS`, a `RABBITMQ_NODENAME`...).
fn foreign_env(prefixes: &[&str]) -> Vec<String> {
    std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| prefixes.iter().any(|p| k.starts_with(p)))
        .collect()
}

// ---- processes -------------------------------------------------------------------------------

type SpawnJob = (Command, mpsc::Sender<io::Result<Child>>);

/// Spawns a long-lived server: in a process group of its own, killed by the kernel if this
/// process dies (see the module's notes), forked by a thread that lives as long as the process.
fn spawn_owned(mut command: Command, what: &str) -> anyhow::Result<Proc> {
    command.process_group(0);
    // SAFETY: only prctl, which is async-signal-safe, between fork and exec.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) == -1 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnJob>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (jobs, incoming) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("engines-spawner".into())
            .spawn(move || {
                for (mut command, reply) in incoming {
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("starting the engines' spawner thread");
        Mutex::new(jobs)
    });
    let (reply, answer) = mpsc::channel();
    spawner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((command, reply))
        .map_err(|_| anyhow!("the spawner thread is gone"))?;
    let child = answer
        .recv()
        .map_err(|_| anyhow!("the spawner thread is gone"))?
        .with_context(|| format!("spawning {what}"))?;
    Ok(Proc {
        child: Some(child),
        what: what.to_owned(),
    })
}

/// One process as `/proc/PID/stat` shows it.
#[derive(Clone, Copy)]
struct ProcStat {
    pid: i32,
    state: char,
    ppid: i32,
    pgrp: i32,
}

fn proc_stat(pid: i32) -> Option<ProcStat> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
    let rest = &text[text.rfind(')')? + 2..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some(ProcStat {
        pid,
        state,
        ppid,
        pgrp,
    })
}

fn all_processes() -> Vec<ProcStat> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(proc_stat)
        .collect()
}

/// Alive: exists and is neither a zombie nor dead (a zombie has freed everything).
fn pid_alive(pid: i32) -> bool {
    proc_stat(pid).is_some_and(|s| !matches!(s.state, 'Z' | 'X' | 'x'))
}

fn proc_comm(pid: i32) -> String {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// A server process the harness spawned; killed with its whole tree when dropped.
struct Proc {
    child: Option<Child>,
    what: String,
}

impl Proc {
    fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Still running (not yet reaped, and not a zombie either).
    fn alive(&self) -> bool {
        self.child.is_some() && pid_alive(self.pid())
    }

    /// SIGKILL to the process, everything it forked (also what left its process group, like
    /// Erlang's `erl_child_setup`, which calls setsid) and its process group; reaps it and waits
    /// (bounded) until none of them is left.
    fn kill(&mut self) -> anyhow::Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let root = child.id() as i32;
        let me = std::process::id() as i32;
        // While unreaped (alive or zombie), `root` cannot be reused, and neither can it as a
        // process-group id while any member lives: matching on it is safe.
        let mut doomed: HashSet<i32> = HashSet::new();
        for _round in 0..10 {
            let table = all_processes();
            let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
            for p in &table {
                children.entry(p.ppid).or_default().push(p.pid);
            }
            let mut found: Vec<i32> = table
                .iter()
                .filter(|p| p.pgrp == root || p.pid == root)
                .map(|p| p.pid)
                .chain(doomed.iter().copied())
                .collect();
            let mut i = 0;
            while i < found.len() {
                let kids = children.get(&found[i]).cloned().unwrap_or_default();
                for kid in kids {
                    if !found.contains(&kid) {
                        found.push(kid);
                    }
                }
                i += 1;
            }
            let fresh: Vec<i32> = found
                .into_iter()
                .filter(|&p| p != me && p > 1 && !doomed.contains(&p) && pid_alive(p))
                .collect();
            if fresh.is_empty() {
                break;
            }
            for &p in &fresh {
                // SAFETY: plain kill(2).
                unsafe { libc::kill(p, libc::SIGKILL) };
                doomed.insert(p);
            }
        }
        child
            .wait()
            .with_context(|| format!("reaping {}", self.what))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left: Vec<i32> = doomed.iter().copied().filter(|&p| pid_alive(p)).collect();
            if left.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "{}: processes {left:?} survived SIGKILL for 10 s",
                    self.what
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Err(e) = self.kill() {
            eprintln!("engines: {e:#}");
        }
    }
}

/// Runs a command to its end, bounded; its stdout, or an error with its output.
async fn run(
    mut command: tokio::process::Command,
    what: &str,
    limit: Duration,
) -> anyhow::Result<String> {
    command
        .kill_on_drop(true)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let output = tokio::time::timeout(limit, command.output())
        .await
        .map_err(|_| anyhow!("{what}: not finished within {limit:?}"))?
        .with_context(|| format!("{what}: could not run"))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        bail!(
            "{what}: {}\n{}\n{stdout}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(stdout)
}

/// What a probe of [`wait_for`] saw: done, or not yet (and why, for the timeout's message).
enum Step<T> {
    Done(T),
    NotYet(String),
}

/// Polls `probe` until it is done, it fails (fatal: returned at once), or `limit` passes.
async fn wait_for<T, F, Fut>(what: &str, limit: Duration, mut probe: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Step<T>>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    let mut last: String;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let each = Duration::from_secs(10).min(left);
        match tokio::time::timeout(each, probe()).await {
            Ok(Ok(Step::Done(value))) => return Ok(value),
            Ok(Ok(Step::NotYet(why))) => last = why,
            Ok(Err(e)) => return Err(e.context(format!("while waiting for {what}"))),
            Err(_) => last = format!("a probe took over {each:?}"),
        }
        if tokio::time::Instant::now() + Duration::from_millis(100) >= deadline {
            bail!("{what}: not within {limit:?} (last: {last})");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Removes in the background (big data directories take a moment).
async fn remove_dir(path: &Path) -> anyhow::Result<()> {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || match fs::remove_dir_all(&path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(anyhow::Error::from(e).context(format!("removing {}", path.display())))
        }
        _ => Ok(()),
    })
    .await?
}

/// A path segment percent-encoded for the management API (`/` as `%2F`...).
fn encode_segment(segment: &str) -> String {
    segment
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

// ---- RabbitMQ --------------------------------------------------------------------------------

struct RabbitNode {
    /// `<prefix>-N@localhost`, N from 1.
    name: String,
    amqp: PortClaim,
    dist: PortClaim,
    management: PortClaim,
    dir: PathBuf,
    proc: Option<Proc>,
}

/// Three RabbitMQ nodes clustered together, each on its own ports and in its own directory.
/// Nodes are indexed from 0 (`node_name(0)` is `<prefix>-1@localhost`).
///
/// The nodes run as root with `HOME` at the cluster's directory, whose `.erlang.cookie` is the
/// cluster's own: the harness's `rabbitmqctl` calls use it too, and the machine's broker (its
/// cookie is the rabbitmq user's) cannot be reached by mistake.
pub struct RabbitCluster {
    nodes: Vec<RabbitNode>,
    http: reqwest::Client,
    // Last: dropped after the nodes are killed.
    base: TempDir,
}

impl RabbitCluster {
    /// Three nodes `<prefix>-1@localhost` .. `-3` (prefix unique per process and cluster), each
    /// with its own AMQP, Erlang distribution and management HTTP ports, config and
    /// enabled-plugins files, mnesia and log directories; nodes 2 and 3 joined to node 1; waits
    /// until node 1 reports three running nodes.
    pub async fn start() -> anyhow::Result<Self> {
        let base = TempDir::new("rabbit")?;
        let prefix = unique_name("rmq");
        // The cluster's own cookie, readable by its owner only (Erlang insists).
        let cookie = base.path().join(".erlang.cookie");
        fs::write(
            &cookie,
            uuid::Uuid::new_v4().simple().to_string().to_uppercase(),
        )?;
        fs::set_permissions(&cookie, fs::Permissions::from_mode(0o400))?;
        // An empty env file instead of /etc/rabbitmq/rabbitmq-env.conf (NODENAME, ERL_FLAGS).
        fs::write(base.path().join("rabbitmq-env.conf"), "")?;
        let mut nodes = Vec::with_capacity(RABBIT_NODES);
        for n in 1..=RABBIT_NODES {
            let dir = base.path().join(format!("node-{n}"));
            fs::create_dir(&dir)?;
            let management = claim_port()?;
            fs::write(
                dir.join("rabbitmq.conf"),
                format!(
                    "management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {}\n",
                    management.port()
                ),
            )?;
            fs::write(dir.join("enabled_plugins"), "[rabbitmq_management].\n")?;
            nodes.push(RabbitNode {
                name: format!("{prefix}-{n}@localhost"),
                amqp: claim_port()?,
                dist: claim_port()?,
                management,
                dir,
                proc: None,
            });
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()?;
        let mut cluster = Self { nodes, http, base };
        for node in 0..RABBIT_NODES {
            cluster.spawn_node(node)?;
        }
        let this = &cluster;
        futures::future::try_join_all((0..RABBIT_NODES).map(|n| this.wait_node_up(n))).await?;
        // stop_app takes ~5 s (the broker's shutdown), so both joiners stop at once; the joins
        // themselves, schema changes on node 1, go one at a time; both start again at once.
        let seed = &cluster.nodes[0].name;
        futures::future::try_join_all((1..RABBIT_NODES).map(|n| this.ctl(n, &["stop_app"])))
            .await?;
        for node in 1..RABBIT_NODES {
            this.ctl(node, &["join_cluster", seed]).await?;
        }
        futures::future::try_join_all((1..RABBIT_NODES).map(|n| async move {
            this.ctl(n, &["start_app"]).await?;
            this.wait_node_up(n).await
        }))
        .await?;
        let all: Vec<usize> = (0..RABBIT_NODES).collect();
        cluster.wait_cluster_sees(0, &all).await?;
        Ok(cluster)
    }

    pub fn amqp_addr(&self, node: usize) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.nodes[node].amqp.port()))
    }

    /// `http://127.0.0.1:PORT` (user guest, password guest).
    pub fn management_url(&self, node: usize) -> String {
        format!("http://127.0.0.1:{}", self.nodes[node].management.port())
    }

    pub fn node_name(&self, node: usize) -> String {
        self.nodes[node].name.clone()
    }

    /// The node's Erlang VM is alive and its AMQP port accepts connections.
    pub fn is_running(&self, node: usize) -> bool {
        self.nodes[node].proc.as_ref().is_some_and(Proc::alive)
            && StdTcpStream::connect_timeout(&self.amqp_addr(node), Duration::from_secs(1)).is_ok()
    }

    /// kill -9 the node's Erlang VM and everything it started. The pid killed is checked to be
    /// the `beam.smp` the node wrote in its pid file (the child itself: the start script
    /// `exec`s into the VM when `RABBITMQ_ALLOW_INPUT` is set). Panics if that does not hold or
    /// if any process of the node survives.
    pub fn kill(&mut self, node: usize) {
        let n = &mut self.nodes[node];
        let Some(mut proc) = n.proc.take() else {
            return;
        };
        let pid = proc.pid();
        if pid_alive(pid) {
            let comm = proc_comm(pid);
            assert_eq!(
                comm, "beam.smp",
                "{}: pid {pid} is not the Erlang VM",
                n.name
            );
            let written = fs::read_to_string(n.dir.join("beam.pid")).unwrap_or_default();
            assert_eq!(
                written.trim(),
                pid.to_string(),
                "{}: the pid file does not name the VM the harness started",
                n.name
            );
        }
        if let Err(e) = proc.kill() {
            panic!("killing {}: {e:#}", n.name);
        }
    }

    /// Starts a killed node again with the same name, ports and data; waits until it runs and
    /// another running node lists it as running. Restart a node while another one runs: a
    /// node restarted while all its peers are down waits for them (Mnesia) past this bound.
    pub async fn restart(&mut self, node: usize) -> anyhow::Result<()> {
        if self.nodes[node].proc.as_ref().is_some_and(Proc::alive) {
            bail!("{} is running: kill it first", self.nodes[node].name);
        }
        self.nodes[node].proc = None;
        self.spawn_node(node)?;
        self.wait_node_up(node).await?;
        let witness = (0..RABBIT_NODES)
            .find(|&n| n != node && self.is_running(n))
            .unwrap_or(node);
        self.wait_cluster_sees(witness, &[node]).await
    }

    /// The node leading quorum queue `queue` of `vhost`, from the management API of the first
    /// running node that answers; `None` while the queue reports no leader (or one outside the
    /// cluster). An error if no running node answers or the queue does not exist.
    pub async fn leader_of(&self, vhost: &str, queue: &str) -> anyhow::Result<Option<usize>> {
        let path = format!(
            "/api/queues/{}/{}",
            encode_segment(vhost),
            encode_segment(queue)
        );
        let mut errors = Vec::new();
        for node in (0..RABBIT_NODES).filter(|&n| self.is_running(n)) {
            match self.management_get(node, &path).await {
                Ok(body) => {
                    let leader = body.get("leader").and_then(Value::as_str);
                    return Ok(leader.and_then(|l| self.nodes.iter().position(|n| n.name == l)));
                }
                Err(e) => errors.push(format!("{}: {e:#}", self.nodes[node].name)),
            }
        }
        bail!("no running node answered for {path}: {errors:?}")
    }

    fn spawn_node(&mut self, node: usize) -> anyhow::Result<()> {
        let base = self.base.path();
        let n = &self.nodes[node];
        let console = append_file(&n.dir.join("console.log"))?;
        let mut command = Command::new(RABBITMQ_SERVER);
        for var in foreign_env(&["RABBITMQ_", "ERL_"]) {
            command.env_remove(var);
        }
        command
            .current_dir(&n.dir)
            .env("HOME", base)
            .env("RABBITMQ_CONF_ENV_FILE", base.join("rabbitmq-env.conf"))
            .env("RABBITMQ_NODENAME", &n.name)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", n.amqp.port().to_string())
            .env("RABBITMQ_DIST_PORT", n.dist.port().to_string())
            .env("RABBITMQ_MNESIA_BASE", n.dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", n.dir.join("log"))
            .env("RABBITMQ_CONFIG_FILE", n.dir.join("rabbitmq.conf"))
            .env(
                "RABBITMQ_ADVANCED_CONFIG_FILE",
                n.dir.join("advanced.config"),
            )
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                n.dir.join("enabled_plugins"),
            )
            .env("RABBITMQ_PID_FILE", n.dir.join("beam.pid"))
            // Makes the start script `exec` the VM rather than run it under a waiting shell...
            .env("RABBITMQ_ALLOW_INPUT", "true")
            // ...and -noinput keeps the VM from reading stdin anyway; distribution on loopback.
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-noinput -kernel inet_dist_use_interface {127,0,0,1}",
            )
            .env("ERL_CRASH_DUMP", n.dir.join("erl_crash.dump"))
            .stdin(Stdio::null())
            .stdout(console.try_clone()?)
            .stderr(console);
        let proc = spawn_owned(command, &n.name)?;
        self.nodes[node].proc = Some(proc);
        Ok(())
    }

    /// Why a node is not up, with its logs, if its VM has exited.
    fn check_alive(&self, node: usize) -> anyhow::Result<()> {
        let n = &self.nodes[node];
        if n.proc.as_ref().is_some_and(Proc::alive) {
            return Ok(());
        }
        bail!(
            "{} is not running\n{}\n{}",
            n.name,
            log_tail(&n.dir.join("console.log"), 20),
            log_tail(&n.dir.join("log").join(format!("{}.log", n.name)), 30)
        )
    }

    async fn management_get(&self, node: usize, path: &str) -> anyhow::Result<Value> {
        let response = self
            .http
            .get(format!("{}{path}", self.management_url(node)))
            .basic_auth("guest", Some("guest"))
            .send()
            .await?;
        let status = response.status();
        if !status.is_success() {
            bail!(
                "GET {path}: {status}: {}",
                response.text().await.unwrap_or_default()
            );
        }
        Ok(response.json().await?)
    }

    /// Until the node's own management API reports it running (the broker app is started).
    async fn wait_node_up(&self, node: usize) -> anyhow::Result<()> {
        let name = &self.nodes[node].name;
        let path = &format!("/api/nodes/{}", encode_segment(name));
        wait_for(
            &format!("{name} to run"),
            Duration::from_secs(120),
            move || async move {
                self.check_alive(node)?;
                Ok(match self.management_get(node, path).await {
                    Ok(body) if body["running"] == Value::Bool(true) => Step::Done(()),
                    Ok(body) => Step::NotYet(format!("running: {}", body["running"])),
                    Err(e) => Step::NotYet(format!("{e:#}")),
                })
            },
        )
        .await
    }

    /// Until node `via` lists every node of `want` as a running member of its cluster.
    async fn wait_cluster_sees(&self, via: usize, want: &[usize]) -> anyhow::Result<()> {
        let what = format!(
            "{} to see {:?} running in its cluster",
            self.nodes[via].name,
            want.iter()
                .map(|&n| &self.nodes[n].name)
                .collect::<Vec<_>>()
        );
        wait_for(&what, Duration::from_secs(120), move || async move {
            self.check_alive(via)?;
            let body = match self.management_get(via, "/api/nodes").await {
                Ok(body) => body,
                Err(e) => return Ok(Step::NotYet(format!("{e:#}"))),
            };
            let running: Vec<&str> = body
                .as_array()
                .into_iter()
                .flatten()
                .filter(|n| n["running"] == Value::Bool(true))
                .filter_map(|n| n["name"].as_str())
                .collect();
            Ok(
                if want
                    .iter()
                    .all(|&w| running.contains(&self.nodes[w].name.as_str()))
                {
                    Step::Done(())
                } else {
                    Step::NotYet(format!("running: {running:?}"))
                },
            )
        })
        .await
    }

    /// `rabbitmqctl -n NODE args...` with the cluster's cookie; its stdout.
    async fn ctl(&self, node: usize, args: &[&str]) -> anyhow::Result<String> {
        let base = self.base.path();
        let name = &self.nodes[node].name;
        let mut command = tokio::process::Command::new(RABBITMQCTL);
        for var in foreign_env(&["RABBITMQ_", "ERL_"]) {
            command.env_remove(var);
        }
        command
            .current_dir(base)
            .env("HOME", base)
            .env("RABBITMQ_CONF_ENV_FILE", base.join("rabbitmq-env.conf"))
            .arg("-n")
            .arg(name)
            .args(args);
        let what = format!("rabbitmqctl -n {name} {}", args.join(" "));
        run(command, &what, Duration::from_secs(120)).await
    }
}

impl Drop for RabbitCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut proc) = node.proc.take() {
                if let Err(e) = proc.kill() {
                    eprintln!("engines: {e:#}");
                }
            }
        }
        // `base` goes next, with every node's data and logs.
    }
}

// ---- PostgreSQL ------------------------------------------------------------------------------

/// The postgres OS user: Postgres refuses to run as root.
#[derive(Clone, Copy)]
struct PgUser {
    uid: u32,
    gid: u32,
}

fn postgres_user() -> anyhow::Result<(PgUser, &'static str)> {
    static USER: OnceLock<Option<(PgUser, String)>> = OnceLock::new();
    let found = USER.get_or_init(|| {
        // SAFETY: getpwnam's result is read at once, before any other call could reuse it
        // (the OnceLock runs this once, and nothing else in the tests calls getpw*).
        unsafe {
            let pw = libc::getpwnam(c"postgres".as_ptr());
            if pw.is_null() {
                return None;
            }
            let home = std::ffi::CStr::from_ptr((*pw).pw_dir)
                .to_string_lossy()
                .into_owned();
            Some((
                PgUser {
                    uid: (*pw).pw_uid,
                    gid: (*pw).pw_gid,
                },
                home,
            ))
        }
    });
    match found {
        Some((user, home)) => Ok((*user, home.as_str())),
        None => bail!("there is no postgres user on this machine"),
    }
}

/// An empty directory owned by postgres, mode 0700 (what initdb and the postmaster demand).
fn make_pg_dir(path: &Path, user: PgUser) -> anyhow::Result<()> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e.into()),
        _ => {}
    }
    fs::create_dir(path)?;
    std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o700))?;
    Ok(())
}

/// After a postmaster was killed, its small System V shared memory segment (named in line 7
/// of postmaster.pid) stays behind; removed when nothing is attached any more.
fn remove_pg_sysv_segment(data: &Path) {
    let Ok(text) = fs::read_to_string(data.join("postmaster.pid")) else {
        return;
    };
    let Some(line) = text.lines().nth(6) else {
        return;
    };
    let mut fields = line.split_whitespace();
    let (Some(Ok(key)), Some(Ok(id))) = (
        fields.next().map(str::parse::<i32>),
        fields.next().map(str::parse::<i32>),
    ) else {
        return;
    };
    // SAFETY: System V calls on a zeroed, correctly sized struct.
    unsafe {
        if libc::shmget(key, 0, 0) != id {
            return; // Gone already, or the key now names another segment.
        }
        let mut stat: libc::shmid_ds = std::mem::zeroed();
        if libc::shmctl(id, libc::IPC_STAT, &mut stat) == 0 && stat.shm_nattch == 0 {
            libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut());
        }
    }
}

struct PgServer {
    /// Also its application_name as a standby: `pg0`, `pg1`.
    name: String,
    port: PortClaim,
    data: PathBuf,
    log: PathBuf,
    proc: Option<Proc>,
}

/// A PostgreSQL 15 primary and a synchronous streaming standby, on two fixed addresses; after
/// a failover the roles swap ([`PgPair::primary`] says which is which), so a campaign can
/// fail over again and again.
///
/// Postgres refuses to run as root: its tools and the postmaster run as the postgres user by
/// the harness's own setuid (`Command::uid/gid`) rather than `runuser`, so the postmaster is the
/// harness's child (the pid killed, PDEATHSIG kept) and a tool past its bound is itself killed,
/// not a `runuser` parent. Both listen on 127.0.0.1 only, no Unix socket (no collision in
/// /var/run/postgresql), dynamic shared memory in the data directory (nothing left in /dev/shm
/// by a kill -9).
pub struct PgPair {
    servers: [PgServer; 2],
    primary: usize,
    /// In `cluster_name`, so `ps` tells this pair's processes apart.
    label: String,
    // Last: dropped after the servers are killed.
    base: TempDir,
}

impl PgPair {
    /// initdb (trust for local and 127.0.0.1, replication too), a primary on a claimed port
    /// (wal_level replica, synchronous_commit on, synchronous_standby_names naming the
    /// standby), a standby made by pg_basebackup -R streaming from it; waits until the
    /// primary reports the standby's `sync_state = 'sync'`.
    pub async fn start() -> anyhow::Result<Self> {
        let (user, _) = postgres_user()?;
        let base = TempDir::new("pg")?;
        let label = unique_name("pg");
        let mut servers = Vec::with_capacity(2);
        for i in 0..2 {
            let data = base.path().join(format!("pg{i}"));
            make_pg_dir(&data, user)?;
            servers.push(PgServer {
                name: format!("pg{i}"),
                port: claim_port()?,
                data,
                log: base.path().join(format!("pg{i}.log")),
                proc: None,
            });
        }
        let servers: [PgServer; 2] = servers.try_into().map_err(|_| anyhow!("two servers"))?;
        let mut pair = Self {
            servers,
            primary: 0,
            label,
            base,
        };
        let data = pair.servers[0].data.display().to_string();
        let mut initdb = pair.pg_tool("initdb")?;
        initdb.args(["-D", &data, "-U", "postgres", "--auth=trust", "-E", "UTF8"]);
        initdb.args(["--locale=C", "--no-sync"]);
        run(initdb, "initdb", Duration::from_secs(120)).await?;
        pair.configure_initial()?;
        pair.start_server(0).await?;
        pair.make_standby(0, 1).await?;
        Ok(pair)
    }

    /// Both servers, fixed for the pair's life.
    pub fn addrs(&self) -> [SocketAddr; 2] {
        [0, 1].map(|i| SocketAddr::from((Ipv4Addr::LOCALHOST, self.servers[i].port.port())))
    }

    /// Index into [`PgPair::addrs`] of the current primary.
    pub fn primary(&self) -> usize {
        self.primary
    }

    /// kill -9 the primary's postmaster (the pid in its postmaster.pid, which is the child the
    /// harness started) and its whole process group: its backends die with it.
    pub fn kill_primary(&mut self) {
        let s = &mut self.servers[self.primary];
        let Some(mut proc) = s.proc.take() else {
            return;
        };
        if proc.alive() {
            let written = fs::read_to_string(s.data.join("postmaster.pid")).unwrap_or_default();
            assert_eq!(
                written.lines().next().unwrap_or("").trim(),
                proc.pid().to_string(),
                "{}: postmaster.pid does not name the postmaster the harness started",
                s.name
            );
        }
        if let Err(e) = proc.kill() {
            panic!("killing {}: {e:#}", s.name);
        }
        remove_pg_sysv_segment(&s.data);
    }

    /// A fast shutdown of the primary (SIGINT to its postmaster: every session is ended with
    /// "terminating connection due to administrator command", as `pg_ctl restart -m fast`
    /// does), then the same server started again on its data; waits until it takes
    /// connections.
    pub async fn restart_primary(&mut self) -> anyhow::Result<()> {
        let primary = self.primary;
        let s = &mut self.servers[primary];
        let proc = s
            .proc
            .take()
            .ok_or_else(|| anyhow!("{} is not running", s.name))?;
        // SAFETY: kill(2) with the pid of the postmaster the harness started and still owns.
        if unsafe { libc::kill(proc.pid(), libc::SIGINT) } != 0 {
            bail!("signalling {}: {}", s.name, std::io::Error::last_os_error());
        }
        let name = s.name.clone();
        wait_for(
            &format!("{name} to shut down"),
            Duration::from_secs(60),
            || async {
                Ok(if proc.alive() {
                    Step::NotYet("still running".to_owned())
                } else {
                    Step::Done(())
                })
            },
        )
        .await?;
        drop(proc);
        self.start_server(primary).await
    }

    /// `pg_ctl promote` the standby and wait until it accepts writes (a commit returns). Until
    /// [`PgPair::rebuild_standby`] gives it a standby again, the new primary commits alone: every
    /// standby is made with an empty synchronous_standby_names (see `make_standby`), so that once
    /// promoted it does not wait for a standby that does not exist. The old primary, if still
    /// running, is left as it is (a split brain, if that is what the campaign wants).
    pub async fn promote_standby(&mut self) -> anyhow::Result<()> {
        let standby = 1 - self.primary;
        self.check_alive(standby)?;
        let data = self.servers[standby].data.display().to_string();
        let mut promote = self.pg_tool("pg_ctl")?;
        promote.args(["promote", "-D", &data, "-w", "-t", "60"]);
        run(promote, "pg_ctl promote", Duration::from_secs(90)).await?;
        let url = &self.url(standby, "postgres");
        let this = &*self;
        let leave_recovery = move || async move {
            this.check_alive(standby)?;
            let mut conn = match sqlx::PgConnection::connect(url).await {
                Ok(conn) => conn,
                Err(e) => return Ok(Step::NotYet(e.to_string())),
            };
            let recovering: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
                .fetch_one(&mut conn)
                .await?;
            Ok(if recovering {
                Step::NotYet("still in recovery".into())
            } else {
                Step::Done(())
            })
        };
        wait_for(
            "the promoted standby to leave recovery",
            Duration::from_secs(60),
            leave_recovery,
        )
        .await?;
        self.primary = standby;
        // A commit that returns: really accepting writes, no synchronous wait left.
        wait_for(
            "the new primary to commit a write",
            Duration::from_secs(60),
            move || async move {
                let mut conn = sqlx::PgConnection::connect(url).await?;
                let commit =
                    sqlx::query_scalar::<_, i64>("SELECT txid_current()").fetch_one(&mut conn);
                Ok(
                    match tokio::time::timeout(Duration::from_secs(5), commit).await {
                        Ok(result) => result.map(|_| Step::Done(()))?,
                        Err(_) => Step::NotYet("a commit hung".into()),
                    },
                )
            },
        )
        .await
    }

    /// After a failover: makes the old primary (killed first if it still runs) a new
    /// synchronous standby of the current primary: its data directory wiped, pg_basebackup -R
    /// from the primary with its application_name, started, named in the primary's
    /// synchronous_standby_names (ALTER SYSTEM + pg_reload_conf), and waited for until
    /// `sync_state = 'sync'`.
    pub async fn rebuild_standby(&mut self) -> anyhow::Result<()> {
        let old = 1 - self.primary;
        if let Some(mut proc) = self.servers[old].proc.take() {
            proc.kill()?;
        }
        remove_pg_sysv_segment(&self.servers[old].data);
        self.make_standby(self.primary, old).await
    }

    /// `postgres://postgres@127.0.0.1:PORT/DATABASE` on server `server` (0 or 1).
    pub fn url(&self, server: usize, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{database}",
            self.servers[server].port.port()
        )
    }

    /// A postgres tool run as the postgres user, with a clean PG* environment.
    fn pg_tool(&self, tool: &str) -> anyhow::Result<tokio::process::Command> {
        let (user, home) = postgres_user()?;
        let mut command = tokio::process::Command::new(format!("{PG_BIN}/{tool}"));
        for var in foreign_env(&["PG"]) {
            command.env_remove(var);
        }
        command
            .uid(user.uid)
            .gid(user.gid)
            .env("HOME", home)
            .env("USER", "postgres")
            .env("LOGNAME", "postgres")
            .current_dir(self.base.path());
        Ok(command)
    }

    /// Settings every server of the pair shares (copied to standbys by pg_basebackup); the port
    /// is per server, on the postmaster's command line. wal_retrieve_retry_interval: a standby
    /// whose primary died retries streaming every 5 s by default, and a promotion arriving in
    /// that sleep waited for its end (`pg_ctl promote` took 5.3 s instead of 0.1 s).
    fn configure_initial(&self) -> anyhow::Result<()> {
        let data = &self.servers[0].data;
        let mut conf = fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))?;
        conf.write_all(
            b"\n# relay-tests engines harness\n\
              listen_addresses = '127.0.0.1'\n\
              unix_socket_directories = ''\n\
              max_connections = 200\n\
              shared_buffers = 64MB\n\
              wal_level = replica\n\
              max_wal_senders = 10\n\
              hot_standby = on\n\
              synchronous_commit = on\n\
              fsync = on\n\
              dynamic_shared_memory_type = mmap\n\
              wal_retrieve_retry_interval = 100ms\n\
              log_line_prefix = '%m [%p] '\n",
        )?;
        // Existing files keep their owner (postgres) when rewritten by root.
        fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\n\
             host all all 127.0.0.1/32 trust\n\
             local replication all trust\n\
             host replication all 127.0.0.1/32 trust\n",
        )?;
        Ok(())
    }

    fn check_alive(&self, server: usize) -> anyhow::Result<()> {
        let s = &self.servers[server];
        if s.proc.as_ref().is_some_and(Proc::alive) {
            return Ok(());
        }
        bail!("{} is not running\n{}", s.name, log_tail(&s.log, 30))
    }

    /// Starts the postmaster itself (the harness's child, as postgres) and waits until it
    /// takes connections (a standby: once consistent).
    async fn start_server(&mut self, server: usize) -> anyhow::Result<()> {
        let (user, home) = postgres_user()?;
        let s = &self.servers[server];
        let log = append_file(&s.log)?;
        let mut command = Command::new(format!("{PG_BIN}/postgres"));
        for var in foreign_env(&["PG"]) {
            command.env_remove(var);
        }
        command
            .arg("-D")
            .arg(&s.data)
            .arg("-p")
            .arg(s.port.port().to_string())
            .arg("-c")
            .arg(format!("cluster_name={}-{}", self.label, s.name))
            .uid(user.uid)
            .gid(user.gid)
            .env("HOME", home)
            .env("USER", "postgres")
            .env("LOGNAME", "postgres")
            .current_dir(self.base.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let proc = spawn_owned(command, &format!("postgres {}", s.name))?;
        self.servers[server].proc = Some(proc);
        let url = &self.url(server, "postgres");
        let what = format!("{} to take connections", self.servers[server].name);
        let this = &*self;
        wait_for(&what, Duration::from_secs(60), move || async move {
            this.check_alive(server)?;
            let mut conn = match sqlx::PgConnection::connect(url).await {
                Ok(conn) => conn,
                Err(e) => return Ok(Step::NotYet(e.to_string())),
            };
            sqlx::query("SELECT 1").execute(&mut conn).await?;
            Ok(Step::Done(()))
        })
        .await
    }

    /// `standby` from scratch: base backup of `primary`, started, made synchronous.
    async fn make_standby(&mut self, primary: usize, standby: usize) -> anyhow::Result<()> {
        let (user, _) = postgres_user()?;
        let data = self.servers[standby].data.clone();
        remove_dir(&data).await?;
        make_pg_dir(&data, user)?;
        let conninfo = format!(
            "host=127.0.0.1 port={} user=postgres application_name={}",
            self.servers[primary].port.port(),
            self.servers[standby].name
        );
        let data_arg = data.display().to_string();
        let mut backup = self.pg_tool("pg_basebackup")?;
        // -R writes standby.signal and primary_conninfo, application_name included.
        backup.args([
            "-D", &data_arg, "-R", "-X", "stream", "-c", "fast", "-d", &conninfo,
        ]);
        run(backup, "pg_basebackup", Duration::from_secs(300)).await?;
        // The copy names itself in synchronous_standby_names (the primary's setting): emptied,
        // or once promoted its commits would wait for a standby that does not exist. Only
        // ALTER SYSTEM rewrites this file; a later line wins over the copied one.
        let mut auto_conf = fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.auto.conf"))?;
        auto_conf.write_all(b"synchronous_standby_names = ''\n")?;
        self.start_server(standby).await?;
        self.set_synchronous_standby(standby).await?;
        let url = &self.url(primary, "postgres");
        let name = &self.servers[standby].name;
        let what = format!(
            "{name} to stream synchronously from {}",
            self.servers[primary].name
        );
        let this = &*self;
        wait_for(&what, Duration::from_secs(60), move || async move {
            this.check_alive(primary)?;
            this.check_alive(standby)?;
            let mut conn = sqlx::PgConnection::connect(url).await?;
            let state: Option<String> = sqlx::query_scalar(
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = $1",
            )
            .bind(name)
            .fetch_optional(&mut conn)
            .await?;
            Ok(match state.as_deref() {
                Some("sync") => Step::Done(()),
                other => Step::NotYet(format!("sync_state {other:?}")),
            })
        })
        .await
    }

    /// synchronous_standby_names on the current primary: the standby's name.
    async fn set_synchronous_standby(&self, standby: usize) -> anyhow::Result<()> {
        let names = format!("\"{}\"", self.servers[standby].name);
        let mut conn = sqlx::PgConnection::connect(&self.url(self.primary, "postgres")).await?;
        // ALTER SYSTEM may not run in a transaction block: the simple protocol, one statement.
        sqlx::raw_sql(&format!(
            "ALTER SYSTEM SET synchronous_standby_names = '{names}'"
        ))
        .execute(&mut conn)
        .await?;
        sqlx::raw_sql("SELECT pg_reload_conf()")
            .execute(&mut conn)
            .await?;
        Ok(())
    }
}

impl Drop for PgPair {
    fn drop(&mut self) {
        for s in &mut self.servers {
            if let Some(mut proc) = s.proc.take() {
                if let Err(e) = proc.kill() {
                    eprintln!("engines: {e:#}");
                }
            }
            remove_pg_sysv_segment(&s.data);
        }
        // `base` goes next, with both data directories and logs.
    }
}

// ---- Redis -----------------------------------------------------------------------------------

/// A Redis server on a port of its own, keeping nothing on disk (`--save ""`, no AOF).
pub struct RedisServer {
    port: PortClaim,
    proc: Option<Proc>,
    // Last: dropped after the server is killed.
    base: TempDir,
}

impl RedisServer {
    pub async fn start() -> anyhow::Result<Self> {
        let mut server = Self {
            port: claim_port()?,
            proc: None,
            base: TempDir::new("redis")?,
        };
        server.spawn_and_wait().await?;
        Ok(server)
    }

    /// `redis://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port.port())
    }

    /// kill -9, then a fresh server on the same port with nothing in it (every key forgotten);
    /// waits until it answers PING.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        if let Some(mut proc) = self.proc.take() {
            proc.kill()?;
        }
        // Nothing is ever written with these settings; but nothing may come back either.
        for file in ["dump.rdb", "appendonlydir", "appendonly.aof"] {
            let path = self.base.path().join(file);
            let _ = fs::remove_file(&path).or_else(|_| fs::remove_dir_all(&path));
        }
        self.spawn_and_wait().await
    }

    async fn spawn_and_wait(&mut self) -> anyhow::Result<()> {
        let dir = self.base.path();
        let log_path = dir.join("redis.log");
        let log = append_file(&log_path)?;
        let port = self.port.port().to_string();
        let mut command = Command::new(REDIS_SERVER);
        command
            .args([
                "--port",
                &port,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--daemonize", "no", "--logfile", ""])
            .arg("--dir")
            .arg(dir)
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        self.proc = Some(spawn_owned(command, &format!("redis-server :{port}"))?);
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port.port()));
        let proc = self.proc.as_ref().expect("just spawned");
        let log_path = &log_path;
        wait_for(
            "redis-server to answer PING",
            Duration::from_secs(30),
            move || async move {
                if !proc.alive() {
                    bail!("redis-server exited\n{}", log_tail(log_path, 20));
                }
                Ok(match ping(addr).await {
                    Ok(()) => Step::Done(()),
                    Err(e) => Step::NotYet(format!("{e:#}")),
                })
            },
        )
        .await
    }
}

/// PING as an inline command; Ok on +PONG.
async fn ping(addr: SocketAddr) -> anyhow::Result<()> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(b"PING\r\n").await?;
    let mut answer = [0u8; 64];
    let n = stream.read(&mut answer).await?;
    if !answer[..n].starts_with(b"+PONG") {
        bail!("answered {:?}", String::from_utf8_lossy(&answer[..n]));
    }
    Ok(())
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(mut proc) = self.proc.take() {
            if let Err(e) = proc.kill() {
                eprintln!("engines: {e:#}");
            }
        }
    }
}
