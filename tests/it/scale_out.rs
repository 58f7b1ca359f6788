//! Past one machine: two OS processes of every tier at once (two front tiers behind a
//! round-robin balancer, two sequencers and two publishers sharing endpoints and tenants
//! through their leases, two control planes), each started exactly as the `relay` binary runs
//! it, against the simulator with every fault on. Every copy must end equal to the oracle, and
//! each tenant's queue must rebuild it, every change once and in order.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use clap::Parser as _;
use relay_api::Subject;
use relay_simulator::cli::{prepare, send_timeout, SimulateArgs};
use relay_simulator::Simulation;
use relay_tests::{metrics_text, redis_url, seed, RedisPrefix, TestDb, Vhost};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use uuid::Uuid;

use crate::stack::{
    call_api, check_tenant_queue, connect_broker, quiesce, stop_simulation, token_for,
};

/// Set in a child process's environment: the `relay` command line it runs.
const CHILD_ENV: &str = "RELAY_TEST_TIER_CHILD";
/// The control planes' signing key.
const JWT_SECRET: &str = "scale-out-test-signing-key-of-at-least-32-bytes";

/// A tier in a process of its own: `relay::run` on the command line in [`CHILD_ENV`], as the
/// binary's `main` runs it. Runs only when started by the scale-out test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started as a child process by the scale-out test"]
async fn tier_child_process() {
    let Ok(command_line) = std::env::var(CHILD_ENV) else {
        return;
    };
    relay_tests::init_logging();
    let command_line: Vec<String> = serde_json::from_str(&command_line).unwrap();
    let cli = relay::cli::Cli::try_parse_from(command_line).unwrap();
    relay::run(cli).await.unwrap();
}

/// One tier's process, and where its metrics and probes are served.
pub(crate) struct TierProcess {
    name: String,
    metrics: SocketAddr,
    child: Child,
}

impl TierProcess {
    /// `relay <global> <tier> --metrics-listen <metrics>`, in a process of its own.
    pub(crate) fn start(name: &str, global: &[String], tier: &[&str], metrics: SocketAddr) -> Self {
        Self::start_limited(name, global, tier, metrics, None)
    }

    /// As [`TierProcess::start`], with the process's open-file limit (soft and hard) set to
    /// `open_files` when given, as `ulimit -n` would.
    pub(crate) fn start_limited(
        name: &str,
        global: &[String],
        tier: &[&str],
        metrics: SocketAddr,
        open_files: Option<u64>,
    ) -> Self {
        let mut command_line: Vec<String> = vec!["relay".into()];
        command_line.extend(global.iter().cloned());
        command_line.extend(tier.iter().map(|s| s.to_string()));
        command_line.extend(["--metrics-listen".into(), metrics.to_string()]);
        let logs = std::env::var_os("RELAY_TEST_CHILD_LOGS").is_some();
        let output = || {
            if logs {
                Stdio::inherit()
            } else {
                Stdio::null()
            }
        };
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args([
                "--ignored",
                "--exact",
                "scale_out::tier_child_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, serde_json::to_string(&command_line).unwrap())
            .env("RELAY_SEAL_KEYS", relay_tests::SEAL_KEYS)
            .stdout(output())
            .stderr(output())
            .kill_on_drop(true);
        if let Some(open_files) = open_files {
            // SAFETY: setrlimit is async-signal-safe, and nothing else runs between fork and
            // exec here.
            unsafe {
                command.pre_exec(move || {
                    let limit = libc::rlimit {
                        rlim_cur: open_files,
                        rlim_max: open_files,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = command.spawn().unwrap();
        Self {
            name: name.to_owned(),
            metrics,
            child,
        }
    }

    /// `relay <global> api`, listening at `listen`, with the relay's broker at `amqp_url`,
    /// signing tokens with `jwt_secret`.
    pub(crate) fn start_api(
        name: &str,
        global: &[String],
        listen: SocketAddr,
        amqp_url: &str,
        jwt_secret: &str,
    ) -> Self {
        let listen = listen.to_string();
        let tier = [
            "api",
            "--api-listen",
            &listen,
            "--amqp-url",
            amqp_url,
            "--jwt-secret",
            jwt_secret,
        ];
        Self::start(name, global, &tier, free_address())
    }

    /// SIGKILL: nothing in flight finishes.
    pub(crate) async fn kill(mut self) {
        self.child.kill().await.unwrap();
    }

    /// Waits for the process's `/readyz` to answer 200: what it needs answers.
    pub(crate) async fn wait_ready(&self, client: &reqwest::Client) {
        wait_ready(client, self.metrics, &self.name, Duration::from_secs(60)).await;
    }

    /// The sum of the metric family `name`'s series (counters), as the process serves them.
    pub(crate) async fn metric_sum(&self, client: &reqwest::Client, name: &str) -> f64 {
        let text = metrics_text(client, &format!("http://{}/metrics", self.metrics)).await;
        text.lines()
            .filter(|line| {
                line.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
            })
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

/// Waits for `/readyz` at `metrics` (the address of a tier's probes) to answer 200: what the
/// tier needs answers. Panics, naming it `what`, after `limit`.
pub(crate) async fn wait_ready(
    client: &reqwest::Client,
    metrics: SocketAddr,
    what: &str,
    limit: Duration,
) {
    let started = Instant::now();
    loop {
        let ready = client
            .get(format!("http://{metrics}/readyz"))
            .send()
            .await
            .is_ok_and(|answer| answer.status() == 200);
        if ready {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "{what} is not ready after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `relay`'s global options for a test's tiers: the database at `database_url`, the tests'
/// Redis under `key_prefix`, then `more`.
pub(crate) fn global_options(database_url: &str, key_prefix: &str, more: &[&str]) -> Vec<String> {
    let redis_url = redis_url();
    let mut options = vec![
        "--database-url",
        database_url,
        "--redis-url",
        &redis_url,
        "--redis-key-prefix",
        key_prefix,
    ];
    options.extend_from_slice(more);
    options.into_iter().map(str::to_owned).collect()
}

/// A free port on 127.0.0.1 (bound, then let go for the child to bind).
pub(crate) fn free_address() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// A TCP balancer: each new connection goes to the next of `targets` in turn, as a load
/// balancer in front of front-tier replicas does.
pub(crate) async fn round_robin(
    targets: Vec<SocketAddr>,
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut next = 0;
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else {
                return;
            };
            let target = targets[next % targets.len()];
            next += 1;
            tokio::spawn(async move {
                if let Ok(mut outbound) = TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (address, task)
}

/// Registers the simulated feed endpoints `infos` through two control planes (`apis`, signing
/// with `jwt_secret`): a tenant per simulated key made through the first by the operator
/// `operator`, its endpoints registered through the second. Each tenant with its endpoints.
pub(crate) async fn register_through_control_planes(
    client: &reqwest::Client,
    apis: &[String; 2],
    jwt_secret: &str,
    operator: &str,
    infos: &[relay_simulator::EndpointInfo],
    simulator_api: &str,
) -> Vec<(Uuid, Vec<Uuid>)> {
    let operator = token_for(
        jwt_secret.as_bytes(),
        &Subject::Operator {
            name: operator.into(),
        },
    );
    let mut tenants: Vec<(String, Uuid, Vec<Uuid>)> = Vec::new();
    for info in infos {
        if !tenants.iter().any(|(key, _, _)| key == &info.key_token) {
            let body = json!({"name": format!("key {}", tenants.len())});
            let made = call_api(
                client,
                &apis[0],
                "POST",
                "/v1/tenants",
                Some(&operator),
                Some(&body),
            )
            .await;
            assert_eq!(made.status, 201, "{}", made.text);
            let tenant: Uuid = made.json["id"].as_str().unwrap().parse().unwrap();
            tenants.push((info.key_token.clone(), tenant, Vec::new()));
        }
        let (_, tenant, endpoints) = tenants
            .iter_mut()
            .find(|(key, _, _)| key == &info.key_token)
            .unwrap();
        let token = token_for(jwt_secret.as_bytes(), &Subject::Tenant(*tenant));
        let body: Value = json!({
            "id": info.id,
            "lang": info.lang,
            "upstream_base_url": simulator_api,
            "upstream_api_key": info.key_token,
            "secrets": info.secrets,
        });
        let registered = call_api(
            client,
            &apis[1],
            "POST",
            "/v1/endpoints",
            Some(&token),
            Some(&body),
        )
        .await;
        assert_eq!(registered.status, 201, "{}", registered.text);
        endpoints.push(info.id);
    }
    tenants
        .into_iter()
        .map(|(_, tenant, endpoints)| (tenant, endpoints))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_of_every_tier_share_the_work_and_converge() {
    let seed = seed();
    eprintln!("scale-out seed: {seed} (RELAY_TEST_SEED replays it)");
    let db = TestDb::new().await;
    let vhost = tokio::task::spawn_blocking(Vhost::create).await.unwrap();
    let prefix = RedisPrefix(format!("relay-test:{}:", Uuid::new_v4().simple()));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();

    // The simulator's API is plain http on 127.0.0.1.
    let global = global_options(
        &db.url,
        &prefix.0,
        &["--upstream-allow-http", "--upstream-allow-private"],
    );
    let amqp_url = vhost.url();
    let ingest_addresses = [free_address(), free_address()];
    let api_addresses = [free_address(), free_address()];
    let mut tiers = Vec::new();
    for (i, address) in ingest_addresses.iter().enumerate() {
        let listen = address.to_string();
        tiers.push(TierProcess::start(
            &format!("ingest {i}"),
            &global,
            &["ingest", "--listen", &listen],
            free_address(),
        ));
    }
    for i in 0..2 {
        tiers.push(TierProcess::start(
            &format!("sequencer {i}"),
            &global,
            &["sequencer", "--sweep-interval-ms", "200"],
            free_address(),
        ));
        tiers.push(TierProcess::start(
            &format!("publisher {i}"),
            &global,
            &["publisher", "--amqp-url", &amqp_url],
            free_address(),
        ));
    }
    for (i, address) in api_addresses.iter().enumerate() {
        tiers.push(TierProcess::start_api(
            &format!("api {i}"),
            &global,
            *address,
            &amqp_url,
            JWT_SECRET,
        ));
    }
    for tier in &tiers {
        tier.wait_ready(&client).await;
    }

    let (balancer, balancing) = round_robin(ingest_addresses.to_vec()).await;
    let (upstream, workload, infos) = prepare(&SimulateArgs {
        receiver_url: format!("http://{balancer}"),
        endpoints: 6,
        keys: 2,
        seed,
        rate: 40.0,
        duration_s: 8,
        faults: "all".into(),
        time_compression: 3600.0,
        listen: "127.0.0.1:0".into(),
        select_all: true,
        print_endpoints: false,
        quiet: true,
    })
    .unwrap();
    let sim = Simulation::new(upstream, send_timeout(3600.0));
    let simulator_api = format!(
        "http://{}",
        relay_simulator::api::serve(TcpListener::bind("127.0.0.1:0").await.unwrap(), sim.clone())
            .await
            .unwrap()
    );

    let apis = api_addresses.map(|address| format!("http://{address}"));
    let tenants = register_through_control_planes(
        &client,
        &apis,
        JWT_SECRET,
        "scale-out",
        &infos,
        &simulator_api,
    )
    .await;

    let senders = sim.spawn_senders();
    sim.clone()
        .run_workload(workload, 40.0, Duration::from_secs(8))
        .await;
    let ids: Vec<Uuid> = infos.iter().map(|info| info.id).collect();
    let took = quiesce(&db.pool, &sim, &ids, Duration::from_secs(240), seed).await;
    eprintln!("seed {seed}: settled {took:?} after the workload");

    let broker = connect_broker(&amqp_url, "scale-out").await;
    for (tenant, endpoints) in &tenants {
        let (messages, repeats) =
            check_tenant_queue(&broker, &db.pool, &sim, *tenant, endpoints, seed).await;
        eprintln!("seed {seed}: tenant {tenant}: {messages} messages, {repeats} repeats");
    }

    // The balancer sent each front tier its share; the others' shares are their leases' doing.
    for tier in &tiers {
        let figure = match tier.name.split(' ').next().unwrap() {
            "ingest" => {
                tier.metric_sum(&client, "relay_ingest_messages_total")
                    .await
            }
            "sequencer" => {
                tier.metric_sum(&client, "relay_sequencer_messages_total")
                    .await
            }
            "publisher" => {
                tier.metric_sum(&client, "relay_publisher_messages_confirmed_total")
                    .await
            }
            _ => tier.metric_sum(&client, "relay_api_requests_total").await,
        };
        eprintln!("seed {seed}: {}: {figure}", tier.name);
        if tier.name.starts_with("ingest") {
            assert!(figure > 0.0, "seed {seed}: {} answered nothing", tier.name);
        }
    }

    stop_simulation(&sim, senders).await;
    balancing.abort();
    let _ = broker.close(200, "done").await;
}
