//! The `relay simulate` entry: the API, the senders and the workload against any receiver.

use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use serde_json::json;

use crate::driver::Simulation;
use crate::faults::Faults;
use crate::model::World;
use crate::upstream::{SenderConfig, Upstream};
use crate::workload::{EndpointInfo, Workload, WorkloadConfig};

/// Run a simulated upstream against a receiver.
#[derive(Debug, Clone, Args)]
pub struct SimulateArgs {
    /// Where messages go. `{id}` is replaced by the endpoint id; a URL without it gets
    /// `/webhooks/{id}` appended.
    #[arg(
        long,
        env = "RELAY_SIMULATE_RECEIVER_URL",
        default_value = "http://127.0.0.1:8080"
    )]
    pub receiver_url: String,
    /// How many webhook endpoints to create.
    #[arg(long, default_value_t = 3)]
    pub endpoints: usize,
    /// How many tenants (API keys) the endpoints are spread over.
    #[arg(long, default_value_t = 2)]
    pub keys: usize,
    /// Seeds every random choice: the same seed replays the same run.
    #[arg(long, env = "RELAY_SIMULATE_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Feed changes per second.
    #[arg(long, default_value_t = 5.0)]
    pub rate: f64,
    /// How long the workload runs, in seconds.
    #[arg(long, default_value_t = 30)]
    pub duration_s: u64,
    /// `none`, `all`, or `name=probability,...` (duplicate, redeliver_old, rewind, slow_reads,
    /// slow_read_ms, stale_reads, lb_404, access_change_mid_reload, reset_mid_reload, refetch,
    /// cursor_expired).
    #[arg(long, default_value = "none")]
    pub faults: String,
    /// Upstream seconds per real second for every backoff and threshold.
    #[arg(long, default_value_t = 3600.0)]
    pub time_compression: f64,
    /// Where the simulated REST API listens.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Every endpoint selects every item (no random filters, one of which may select nothing
    /// in a short run).
    #[arg(long)]
    pub select_all: bool,
    /// Print the endpoints (id, key, secrets, lang, url) as JSON lines and exit.
    #[arg(long)]
    pub print_endpoints: bool,
    /// Do not print each message and answer.
    #[arg(long)]
    pub quiet: bool,
}

/// The simulated API over HTTPS: the certificate (chain) and key it presents, as PEM files.
/// Both or neither; without them the API is plain http.
#[derive(Debug, Clone, Default, Args)]
pub struct ApiTlsArgs {
    /// The API's certificate chain (PEM), leaf first: with `--tls-key-file`, the API is served
    /// over https.
    #[arg(long, requires = "tls_key_file")]
    pub tls_cert_file: Option<std::path::PathBuf>,
    /// The private key (PEM) of `--tls-cert-file`'s certificate.
    #[arg(long, requires = "tls_cert_file")]
    pub tls_key_file: Option<std::path::PathBuf>,
}

impl ApiTlsArgs {
    /// The server configuration the files make; `None` for plain http.
    pub fn server_config(
        &self,
    ) -> anyhow::Result<Option<std::sync::Arc<tokio_rustls::rustls::ServerConfig>>> {
        let (Some(cert), Some(key)) = (&self.tls_cert_file, &self.tls_key_file) else {
            return Ok(None);
        };
        let cert_pem =
            std::fs::read(cert).with_context(|| format!("reading {}", cert.display()))?;
        let key_pem = std::fs::read(key).with_context(|| format!("reading {}", key.display()))?;
        let config = crate::api::tls_config(&cert_pem, &key_pem)
            .with_context(|| format!("--tls-cert-file {}", cert.display()))?;
        Ok(Some(config))
    }

    /// The API's scheme: `https` when served with a certificate.
    pub fn scheme(&self) -> &'static str {
        if self.tls_cert_file.is_some() {
            "https"
        } else {
            "http"
        }
    }
}

/// The receiver URL template with `{id}` in it.
pub fn url_template(receiver_url: &str) -> String {
    if receiver_url.contains("{id}") {
        receiver_url.to_owned()
    } else {
        format!("{}/webhooks/{{id}}", receiver_url.trim_end_matches('/'))
    }
}

/// How long a send waits for the receiver's answer: the wire file's send timeout, compressed as
/// the run's time is, but never under 2 s of real time (a loaded machine's answers).
pub fn send_timeout(time_compression: f64) -> Duration {
    Duration::from_secs_f64(
        (relay_wire::limits::SEND_TIMEOUT_S as f64 / time_compression.max(1e-9)).max(2.0),
    )
}

/// The upstream, the workload and the endpoints a run with these arguments makes. Deterministic:
/// a receiver (or a test) can call this with the same arguments to learn the endpoints' ids and
/// secrets before the run starts.
pub fn prepare(args: &SimulateArgs) -> anyhow::Result<(Upstream, Workload, Vec<EndpointInfo>)> {
    let faults: Faults = args.faults.parse().context("--faults")?;
    let config = SenderConfig::from_wire_limits(args.time_compression);
    let mut upstream = Upstream::new(World::default(), config, faults.clone(), args.seed);
    let mut workload = Workload::new(
        args.seed,
        WorkloadConfig {
            endpoints: args.endpoints,
            keys: args.keys,
            refetch: faults.refetch,
            random_filters: !args.select_all,
            ..WorkloadConfig::default()
        },
    );
    let infos = workload.setup(&mut upstream, &url_template(&args.receiver_url), 0);
    Ok((upstream, workload, infos))
}

/// Runs the API (over https with `tls`'s files), a sender per endpoint and the workload,
/// printing what was sent and each answer.
pub async fn run(args: SimulateArgs, tls: ApiTlsArgs) -> anyhow::Result<()> {
    let tls_config = tls.server_config()?;
    let (upstream, workload, infos) = prepare(&args)?;
    for info in &infos {
        println!(
            "{}",
            json!({
                "webhook_endpoint_id": info.id.to_string(),
                "api_key": info.key_token,
                "secrets": info.secrets,
                "lang": info.lang,
                "url": info.url,
            })
        );
    }
    if args.print_endpoints {
        return Ok(());
    }
    let sim = Simulation::new(upstream, send_timeout(args.time_compression));
    sim.print_traffic.store(!args.quiet, Ordering::Relaxed);
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("binding the API to {}", args.listen))?;
    let addr = match tls_config {
        Some(config) => crate::api::serve_tls(listener, sim.clone(), config).await?,
        None => crate::api::serve(listener, sim.clone()).await?,
    };
    println!(
        "{}",
        json!({"api_base_url": format!("{}://{addr}", tls.scheme())})
    );
    let senders = sim.spawn_senders();
    let steps = sim
        .clone()
        .run_workload(workload, args.rate, Duration::from_secs(args.duration_s))
        .await;
    let idle = sim.wait_idle(Duration::from_secs(10)).await;
    sim.shutdown();
    for sender in senders {
        let _ = sender.await;
    }
    let upstream = sim.lock();
    for info in &infos {
        println!(
            "{}",
            json!({
                "webhook_endpoint_id": info.id.to_string(),
                "messages_sent": upstream.sent_bodies(info.id).len(),
                "generation": upstream.generation(info.id),
                "paused": upstream.is_paused(info.id),
                "expected_items": upstream.expected_copy(info.id).len(),
            })
        );
    }
    println!("{}", json!({"changes": steps, "all_delivered": idle}));
    Ok(())
}
