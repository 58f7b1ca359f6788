//! Logging, and the listener serving metrics and the health probes.

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus::{Encoder, Registry, TextEncoder};
use relay_netguard::TrustRoots;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::{DefaultFields, Writer};
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::EnvFilter;

use crate::cli::LogFormat;

/// A tier's metrics registry, holding what every tier reports besides its own:
/// `relay_build_info{version, tier}` (always 1: a dashboard joins on it, and sees each process's
/// version) and the process's `process_*` metrics (CPU seconds, resident memory, open file
/// descriptors, start time).
pub fn tier_registry(tier: &str) -> prometheus::Result<Registry> {
    let registry = Registry::new();
    let build_info = prometheus::IntGaugeVec::new(
        prometheus::Opts::new(
            "relay_build_info",
            "The running build: always 1, labelled with the version and the tier (or tiers).",
        ),
        &["version", "tier"],
    )?;
    build_info
        .with_label_values(&[env!("CARGO_PKG_VERSION"), tier])
        .set(1);
    registry.register(Box::new(build_info))?;
    registry.register(Box::new(
        prometheus::process_collector::ProcessCollector::for_self(),
    ))?;
    Ok(registry)
}

/// Logs at `default_level` and above, unless RUST_LOG says otherwise.
pub fn init_logging(format: LogFormat, default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    // Logs on stderr: stdout carries the data of the commands that print some (`relay tail`,
    // `relay restored`, `relay token issue`), to be piped. Colours only for a terminal.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    // A second init (tests start many apps in one process) is not an error worth stopping for.
    // JSON needs no escaping of ours: serde_json escapes every control character in a string.
    let _ = match format {
        LogFormat::Text => builder.fmt_fields(EscapedFields::default()).try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// The text format's fields and message with every control character escaped (`\n`,
/// `\u{1b}`): values come from requests (an endpoint id decoded from `%0a` in a URL, a tenant's
/// name), and a raw line break would forge a log line, an ESC recolour or hide what follows.
#[derive(Debug, Default)]
pub struct EscapedFields(DefaultFields);

impl<'writer> FormatFields<'writer> for EscapedFields {
    fn format_fields<R: RecordFields>(
        &self,
        mut writer: Writer<'writer>,
        fields: R,
    ) -> std::fmt::Result {
        let mut formatted = String::new();
        self.0.format_fields(Writer::new(&mut formatted), fields)?;
        writer.write_str(&escape_controls(&formatted))
    }
}

/// `text` with each control character (C0, DEL, C1) written as its Rust escape.
pub fn escape_controls(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut escaped = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            escaped.extend(c.escape_debug());
        } else {
            escaped.push(c);
        }
    }
    std::borrow::Cow::Owned(escaped)
}

/// The router serving `/metrics` from `registry`, `/healthz` for liveness (the process
/// answers) and `/readyz` for readiness (what the tier needs answers: [`Readiness`]).
pub fn metrics_router(registry: Registry, readiness: Readiness) -> Router {
    Router::new()
        .route("/metrics", get(render_metrics).with_state(registry))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(render_readiness).with_state(readiness))
}

/// Serves [`metrics_router`] on `listener` until the task is aborted.
pub async fn serve_metrics(
    listener: TcpListener,
    registry: Registry,
    readiness: Readiness,
    shared: relay_listener::Shared,
) {
    relay_listener::serve(
        listener,
        metrics_router(registry, readiness),
        relay_listener::ListenerLimits::METRICS,
        shared,
        "metrics",
        std::future::pending(),
    )
    .await
}

/// How long `/readyz` waits for each dependency: under a probe's usual 5 s timeout, so a
/// dependency that hangs is reported as such rather than the probe itself timing out.
const READINESS_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// What a tier needs to do its work, checked afresh by each `/readyz`: Postgres for every tier,
/// Redis for the sequencer and the publisher (their leases), the relay's broker for the
/// publisher. Each check opens a connection of its own, so a pool that is busy with work (or a
/// shared connection that is reconnecting) is not taken for a dependency that is down.
#[derive(Clone, Default)]
pub struct Readiness {
    dependencies: Vec<Dependency>,
}

#[derive(Clone)]
enum Dependency {
    Postgres(PgPool),
    Redis { url: String, trust: TrustRoots },
    Broker { url: String, trust: TrustRoots },
}

impl Dependency {
    fn name(&self) -> &'static str {
        match self {
            Dependency::Postgres(_) => "postgres",
            Dependency::Redis { .. } => "redis",
            Dependency::Broker { .. } => "broker",
        }
    }

    /// `Err` says what failed, without the URL (it may hold a password).
    async fn check(&self) -> Result<(), String> {
        let check = async {
            match self {
                Dependency::Postgres(pool) => {
                    use sqlx::{ConnectOptions as _, Connection as _};
                    let mut connection = pool
                        .connect_options()
                        .connect()
                        .await
                        .map_err(|e| e.to_string())?;
                    sqlx::query("SELECT 1")
                        .execute(&mut connection)
                        .await
                        .map_err(|e| e.to_string())?;
                    connection.close().await.map_err(|e| e.to_string())
                }
                Dependency::Redis { url, trust } => relay_coord::redis_answers(url, trust)
                    .await
                    .map_err(|e| e.to_string()),
                Dependency::Broker { url, trust } => {
                    // Ready when any node of the cluster answers: the publisher moves to it.
                    let (connection, _) = relay_publisher::connect_any(
                        url,
                        0,
                        "relay readiness",
                        READINESS_CHECK_TIMEOUT,
                        trust,
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                    connection
                        .close(200, "readiness checked")
                        .await
                        .map_err(|e| e.to_string())
                }
            }
        };
        match tokio::time::timeout(READINESS_CHECK_TIMEOUT, check).await {
            Ok(result) => result,
            Err(_) => Err(format!("no answer within {READINESS_CHECK_TIMEOUT:?}")),
        }
    }
}

impl Readiness {
    /// Needs Postgres, reached with `pool`'s settings.
    pub fn postgres(mut self, pool: &PgPool) -> Self {
        self.dependencies.push(Dependency::Postgres(pool.clone()));
        self
    }

    /// Needs Redis at `url`.
    pub fn redis(mut self, url: &str, trust: &TrustRoots) -> Self {
        self.dependencies.push(Dependency::Redis {
            url: url.to_owned(),
            trust: trust.clone(),
        });
        self
    }

    /// Needs the relay's broker at `url`.
    pub fn broker(mut self, url: &str, trust: &TrustRoots) -> Self {
        self.dependencies.push(Dependency::Broker {
            url: url.to_owned(),
            trust: trust.clone(),
        });
        self
    }

    /// Checks every dependency at once: whether all answered, and each one's `"ok"` or error.
    pub async fn check(&self) -> (bool, serde_json::Map<String, serde_json::Value>) {
        let results =
            futures::future::join_all(self.dependencies.iter().map(Dependency::check)).await;
        let mut ready = true;
        let mut checks = serde_json::Map::new();
        for (dependency, result) in self.dependencies.iter().zip(results) {
            let value = match result {
                Ok(()) => "ok".to_owned(),
                Err(error) => {
                    ready = false;
                    error
                }
            };
            checks.insert(dependency.name().to_owned(), value.into());
        }
        (ready, checks)
    }
}

async fn render_readiness(State(readiness): State<Readiness>) -> impl IntoResponse {
    let (ready, checks) = readiness.check().await;
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        axum::Json(serde_json::json!({"ready": ready, "checks": checks})),
    )
}

async fn render_metrics(State(registry): State<Registry>) -> impl IntoResponse {
    let encoder = TextEncoder::new();
    let mut buffer = Vec::new();
    match encoder.encode(&registry.gather(), &mut buffer) {
        Ok(()) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, encoder.format_type().to_owned())],
            buffer,
        )
            .into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

pub async fn bind(address: SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    use anyhow::Context as _;
    let listener = TcpListener::bind(address)
        .await
        .with_context(|| format!("binding the {what} listener to {address}"))?;
    tracing::info!(address = %listener.local_addr()?, "{what} listening");
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::fmt::MakeWriter;

    use super::*;

    /// Collects what a subscriber writes.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Captured {
        type Writer = Captured;
        fn make_writer(&'a self) -> Captured {
            self.clone()
        }
    }

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    const FORGED: &str = "ab\n2026-12-01T00:00:00Z  INFO forged: admin logged in\u{1b}[2K\r\u{0}";

    fn log_hostile_values() {
        let span = tracing::info_span!("request", endpoint = %FORGED);
        let _entered = span.enter();
        tracing::info!(endpoint = %FORGED, name = FORGED, "message {}", FORGED);
    }

    #[test]
    fn text_logs_escape_control_characters_in_fields_spans_and_messages() {
        let captured = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(captured.clone())
            .with_ansi(true)
            .fmt_fields(EscapedFields::default())
            .finish();
        tracing::subscriber::with_default(subscriber, log_hostile_values);
        let text = captured.text();
        assert_eq!(
            text.matches('\n').count(),
            1,
            "one event, one line: {text:?}"
        );
        assert!(!text.contains('\r') && !text.contains('\0'), "{text:?}");
        // The formatter's own colours stay; the values' ESC does not.
        assert!(!text.contains("\u{1b}[2K"), "{text:?}");
        assert_eq!(
            text.matches("ab\\n2026").count(),
            4,
            "span, two fields, message: {text:?}"
        );
        assert!(text.contains("\\u{1b}[2K"), "{text:?}");
    }

    #[test]
    fn json_logs_are_escaped_by_serde() {
        let captured = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(captured.clone())
            .json()
            .finish();
        tracing::subscriber::with_default(subscriber, log_hostile_values);
        let text = captured.text();
        assert_eq!(text.matches('\n').count(), 1, "{text:?}");
        assert!(!text.contains('\u{1b}') && !text.contains('\r'), "{text:?}");
        let line: serde_json::Value = serde_json::from_str(text.trim_end()).unwrap();
        assert_eq!(line["fields"]["endpoint"], FORGED);
    }
}
