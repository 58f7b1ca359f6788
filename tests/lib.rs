//! Helpers for the cross-crate tests: a database of its own per test, the real front tier on
//! port 0, signed messages, and a Postgres proxy that can fail on command.
//!
//! Each test gets a fresh database (`relay_test_<random>`), migrated, dropped when the test's
//! [`TestDb`] is dropped, so tests run at once and leave nothing behind.

pub mod engines;
pub mod readback;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use relay::startup::IngestServer;
use relay_ingest::{Clock, IngestConfig, SystemClock};
use relay_store::endpoints::{self, NewEndpoint};
use relay_store::{tenants, PoolOptions};
use relay_wire::SigningSecret;
use sqlx::PgPool;
use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use uuid::Uuid;

/// The key-encryption key every test seals secrets under (RELAY_SEAL_KEYS for the processes
/// tests start): made for the tests, never for a deployment.
pub const SEAL_KEYS: &str = "test-2026=dGVzdHMtb25seS1ub3QtYS1yZWFsLWtleS0wMTIzNDU=";

/// [`SEAL_KEYS`] as a keyring.
pub fn keys() -> relay_store::Keyring {
    relay_store::Keyring::new(Arc::new(
        relay_seal::LocalKeys::parse(SEAL_KEYS).expect("the tests' key parses"),
    ))
}

/// Where the tests' databases are created. Override with RELAY_TEST_DATABASE_URL.
pub fn server_url() -> String {
    std::env::var("RELAY_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

fn with_database(url: &str, database: &str) -> String {
    let (base, _) = url.rsplit_once('/').expect("a database URL has a path");
    format!("{base}/{database}")
}

pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// A stored message, as a test reads it back to check what the front tier kept.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct StoredRow {
    pub endpoint_id: Uuid,
    pub arrival_seq: i64,
    pub tenant_id: Uuid,
    pub webhook_id: String,
    pub signed_at: time::OffsetDateTime,
    pub attempt: Option<i32>,
    pub received_at: time::OffsetDateTime,
    pub track: Option<String>,
    pub generation: Option<i64>,
    pub body: Vec<u8>,
}

/// A migrated database that exists for one test.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

impl TestDb {
    /// The tenant the endpoint was registered for.
    pub async fn tenant_of(&self, endpoint: Uuid) -> relay_store::TenantId {
        sqlx::query_scalar("SELECT tenant_id FROM webhook_endpoints WHERE id = $1")
            .bind(endpoint)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// The endpoint's stored messages in arrival order.
    pub async fn stored_messages(&self, endpoint: Uuid) -> Vec<StoredRow> {
        sqlx::query_as(
            "SELECT endpoint_id, arrival_seq, tenant_id, webhook_id, signed_at, attempt,
                    received_at, track, generation, body
             FROM messages WHERE endpoint_id = $1 ORDER BY arrival_seq",
        )
        .bind(endpoint)
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }

    pub async fn new() -> Self {
        let db = Self::empty().await;
        relay_store::MIGRATOR
            .run(&db.pool)
            .await
            .expect("migrating the test database");
        db
    }

    /// A database of the test's own with nothing in it (dropped with the value).
    async fn empty() -> Self {
        init_logging();
        let name = format!("relay_test_{}", Uuid::new_v4().simple());
        let admin = sqlx::PgPool::connect(&server_url())
            .await
            .expect("the tests need Postgres (see README: Testing)");
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await
            .expect("creating the test database");
        admin.close().await;
        let url = with_database(&server_url(), &name);
        let pool = relay_store::connect(&url, &PoolOptions::default()).unwrap();
        Self { name, url, pool }
    }

    /// An operator's backup of the database as it is now: `pg_dump -Fc` (PostgreSQL's client
    /// tools on the PATH), the archive's bytes.
    pub async fn dump(&self) -> Vec<u8> {
        let output = tokio::process::Command::new("pg_dump")
            .args(["--format=custom", "--dbname", &self.url])
            .output()
            .await
            .expect("the restore tests need pg_dump (PostgreSQL's client tools)");
        assert!(
            output.status.success(),
            "pg_dump of {}: {}",
            self.name,
            String::from_utf8_lossy(&output.stderr)
        );
        output.stdout
    }

    /// A fresh database (dropped with the value, like every test's) holding `archive`, a
    /// [`TestDb::dump`], restored by `pg_restore`: the schema and its migrations' record come
    /// from the archive, as in an operator's restore.
    pub async fn restored(archive: &[u8]) -> Self {
        let db = Self::empty().await;
        let mut child = tokio::process::Command::new("pg_restore")
            .args(["--exit-on-error", "--no-owner", "--dbname", &db.url])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the restore tests need pg_restore (PostgreSQL's client tools)");
        // Written while pg_restore runs; a pg_restore that stops early says why in its output.
        let mut stdin = child.stdin.take().expect("piped");
        let archive = archive.to_vec();
        let writer = tokio::spawn(async move {
            let _ = stdin.write_all(&archive).await;
        });
        let output = child.wait_with_output().await.unwrap();
        let _ = writer.await;
        assert!(
            output.status.success(),
            "pg_restore into {}: {}",
            db.name,
            String::from_utf8_lossy(&output.stderr)
        );
        db
    }

    /// A tenant with a random id.
    pub async fn tenant(&self) -> Uuid {
        let id = Uuid::new_v4();
        tenants::create(&self.pool, id, "test tenant")
            .await
            .unwrap();
        id
    }

    /// Registers `id` for `tenant` with one secret.
    pub async fn endpoint(&self, tenant: Uuid, id: Uuid, secret: &SigningSecret) {
        endpoints::create(
            &self.pool,
            &keys(),
            &NewEndpoint {
                id,
                tenant_id: tenant,
                secret: secret.clone(),
                upstream_base_url: None,
                upstream_api_key: None,
            },
        )
        .await
        .unwrap();
    }

    /// Takes the endpoint's next fencing token by a new owner's claim (one more than the last),
    /// without its Redis lock: for tests that drive apply transactions themselves. How owners
    /// claim, and wait for one another, is `sequencer_ownership`'s.
    pub async fn claim_fence(&self, endpoint: Uuid) -> i64 {
        relay_store::fences::claim_endpoint(&self.pool, relay_store::EndpointId(endpoint))
            .await
            .expect("a registered endpoint's fence")
    }
}

/// Runs `sql` on `db`, a statement about one endpoint: `$1` is `endpoint`, `$2` its `tenant`.
pub async fn execute_for(db: &TestDb, sql: &str, endpoint: Uuid, tenant: Uuid) {
    sqlx::query(sql)
        .bind(endpoint)
        .bind(tenant)
        .execute(&db.pool)
        .await
        .unwrap();
}

/// The rows `sql` selects, its one parameter `$1` bound to `key` (an endpoint, a tenant).
pub async fn rows_of<T, K>(pool: &PgPool, sql: &str, key: K) -> Vec<T>
where
    T: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
    K: for<'q> sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send,
{
    sqlx::query_as(sql).bind(key).fetch_all(pool).await.unwrap()
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop runs outside async context (or inside a runtime that is shutting down): use a
        // thread with a runtime of its own.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                if let Ok(admin) = sqlx::PgPool::connect(&server_url()).await {
                    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .execute(&admin)
                        .await;
                }
            });
        })
        .join();
    }
}

/// A fresh random secret.
pub fn random_secret() -> SigningSecret {
    SigningSecret::from_bytes(rand::random::<[u8; 32]>().to_vec()).unwrap()
}

/// A message as the upstream would send it.
#[derive(Debug, Clone)]
pub struct Signed {
    pub webhook_id: String,
    pub timestamp: i64,
    pub signature: String,
    pub attempt: Option<String>,
    pub body: Vec<u8>,
}

impl Signed {
    pub fn new(secrets: &[SigningSecret], body: Vec<u8>) -> Self {
        Self::at(
            secrets,
            body,
            time::OffsetDateTime::now_utc().unix_timestamp(),
        )
    }

    pub fn at(secrets: &[SigningSecret], body: Vec<u8>, timestamp: i64) -> Self {
        let webhook_id = format!("msg_{:032x}", rand::random::<u128>());
        let signature = relay_wire::sign(&webhook_id, timestamp, &body, secrets);
        Self {
            webhook_id,
            timestamp,
            signature,
            attempt: Some("1".into()),
            body,
        }
    }
}

/// A v1 feed message naming `endpoint`, with one updated event whose item is `announcement:n`.
pub fn feed_body(endpoint: Uuid, n: u64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "v": 1, "webhook_endpoint_id": endpoint, "track": "feed", "generation": 1,
        "access_version": "av1", "since": format!("1.{n}"), "through": format!("1.{}", n + 1),
        "complete": true,
        "events": [{
            "id": format!("evt_{n}"), "type": "announcement.updated",
            "subject": format!("announcement:{n}"),
            "sequence": relay_wire::Sequence::from_parts(1, n + 1).as_str(),
            "specversion": "1.0",
            "data": {"type": "item", "feed_item_id": format!("announcement:{n}"),
                     "item_kind": "announcement", "seq": n + 1, "parts": []}
        }]
    }))
    .unwrap()
}

/// A front tier on 127.0.0.1, port 0 (its metrics on another port), its pool on `database_url`
/// sized and timed by `config`'s answer deadline.
pub async fn start_front_tier(
    database_url: &str,
    config: IngestConfig,
    clock: Arc<dyn Clock>,
) -> IngestServer {
    start_front_tier_with_keys(database_url, config, keys(), clock).await
}

/// [`start_front_tier`] opening the endpoints' secrets with `keys` instead of [`SEAL_KEYS`].
pub async fn start_front_tier_with_keys(
    database_url: &str,
    config: IngestConfig,
    keys: relay_store::Keyring,
    clock: Arc<dyn Clock>,
) -> IngestServer {
    let pool = relay_store::connect(
        database_url,
        &PoolOptions {
            max_connections: 8,
            acquire_timeout: config.answer_deadline,
            statement_timeout: Some(config.answer_deadline),
            generic_plans: true,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    IngestServer::start(pool, config, keys, listener, metrics_listener, clock).unwrap()
}

/// Posts `message` with `client` to the front tier at `base_url` as the upstream does; an error
/// when no answer came (connection closed).
pub async fn post_to(
    client: &reqwest::Client,
    base_url: &str,
    endpoint: impl std::fmt::Display,
    message: &Signed,
) -> reqwest::Result<reqwest::Response> {
    let mut request = client
        .post(format!("{base_url}/webhooks/{endpoint}"))
        .header("content-type", "application/json")
        .header("user-agent", "Quanor-Webhooks/1")
        .header("webhook-id", &message.webhook_id)
        .header("webhook-timestamp", message.timestamp.to_string())
        .header("webhook-signature", &message.signature)
        .body(message.body.clone());
    if let Some(attempt) = &message.attempt {
        request = request.header("quanor-webhook-attempt", attempt);
    }
    request.send().await
}

/// The real front tier on 127.0.0.1, port 0, against a database of its own.
pub struct TestApp {
    pub db: TestDb,
    pub server: Option<IngestServer>,
    pub base_url: String,
    pub metrics_url: String,
    pub client: reqwest::Client,
}

/// Settings for tests: a short deadline so outage tests finish quickly.
pub fn test_config() -> IngestConfig {
    IngestConfig {
        answer_deadline: Duration::from_secs(2),
        retry_after: Duration::from_secs(7),
        ..IngestConfig::default()
    }
}

impl TestApp {
    pub async fn spawn() -> Self {
        Self::spawn_with(test_config(), Arc::new(SystemClock), None).await
    }

    /// The front tier of a whole-relay test: the test settings, and a waker for the sequencers
    /// listening under `key_prefix`.
    pub async fn spawn_waking(key_prefix: &str) -> Self {
        Self::spawn_waking_on(TestDb::new().await, key_prefix).await
    }

    /// The front tier of a whole-relay test (as [`TestApp::spawn_waking`]) on a database the
    /// test made: one restored from a backup, say.
    pub async fn spawn_waking_on(db: TestDb, key_prefix: &str) -> Self {
        Self::spawn_handing_on(db, key_prefix, None).await
    }

    /// The front tier of a whole-relay test that, as in `relay all`, hands the messages it
    /// stores to the sequencer of the same process through `messages` (and wakes the others).
    pub async fn spawn_handing_on(
        db: TestDb,
        key_prefix: &str,
        messages: Option<relay_coord::Handoff<relay_store::cursors::PendingMessage>>,
    ) -> Self {
        let waker = relay_coord::Waker::connect(
            &redis_url(),
            &relay_netguard::TrustRoots::platform(),
            key_prefix,
        )
        .await
        .expect("the whole-relay tests need Redis on 127.0.0.1:6379");
        let config = IngestConfig {
            waker: Some(waker),
            messages_handoff: messages,
            ..test_config()
        };
        Self::start_on(db, config, Arc::new(SystemClock), None).await
    }

    /// Boots the front tier. With `via`, its pool connects through that address (a
    /// [`PgProxy`]) instead of straight to Postgres.
    pub async fn spawn_with(
        config: IngestConfig,
        clock: Arc<dyn Clock>,
        via: Option<SocketAddr>,
    ) -> Self {
        Self::start_on(TestDb::new().await, config, clock, via).await
    }

    async fn start_on(
        db: TestDb,
        config: IngestConfig,
        clock: Arc<dyn Clock>,
        via: Option<SocketAddr>,
    ) -> Self {
        let url = match via {
            Some(proxy) => format!("postgres://postgres@{proxy}/{}", db.name),
            None => db.url.clone(),
        };
        let server = start_front_tier(&url, config, clock).await;
        let base_url = format!("http://{}", server.address);
        let metrics_url = format!("http://{}/metrics", server.metrics_address);
        Self {
            db,
            server: Some(server),
            base_url,
            metrics_url,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap(),
        }
    }

    /// Another front tier on the same database, as a second replica behind a load balancer
    /// would be. Its base URL is `http://{address}`.
    pub async fn replica(&self, config: IngestConfig) -> IngestServer {
        start_front_tier(&self.db.url, config, Arc::new(SystemClock)).await
    }

    /// A tenant and one endpoint with one fresh secret.
    pub async fn endpoint(&self) -> (Uuid, SigningSecret) {
        let tenant = self.db.tenant().await;
        let id = Uuid::new_v4();
        let secret = random_secret();
        self.db.endpoint(tenant, id, &secret).await;
        (id, secret)
    }

    pub async fn post(
        &self,
        endpoint: impl std::fmt::Display,
        message: &Signed,
    ) -> reqwest::Response {
        self.try_post_to(&self.base_url, endpoint, message)
            .await
            .expect("the front tier answers")
    }

    /// Posts to the front tier at `base_url`; an error when no answer came (connection closed).
    pub async fn try_post_to(
        &self,
        base_url: &str,
        endpoint: impl std::fmt::Display,
        message: &Signed,
    ) -> reqwest::Result<reqwest::Response> {
        post_to(&self.client, base_url, endpoint, message).await
    }

    /// The value of one series of `/metrics`, e.g.
    /// `relay_ingest_messages_total{outcome="accepted"}`.
    pub async fn metric(&self, series: &str) -> f64 {
        let text = metrics_text(&self.client, &self.metrics_url).await;
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{series} is not in /metrics:\n{text}"))
    }

    /// How many messages the front tier answered with `outcome`
    /// (`relay_ingest_messages_total`).
    pub async fn answered(&self, outcome: &str) -> f64 {
        self.metric(&format!(
            "relay_ingest_messages_total{{outcome=\"{outcome}\"}}"
        ))
        .await
    }

    pub async fn stored_webhook_ids(&self, endpoint: Uuid) -> Vec<String> {
        self.db
            .stored_messages(endpoint)
            .await
            .into_iter()
            .map(|m| m.webhook_id)
            .collect()
    }

    pub async fn stop(mut self) {
        if let Some(server) = self.server.take() {
            server.stop().await.unwrap();
        }
    }
}

/// The metrics a process serves at `url`, as text.
pub async fn metrics_text(client: &reqwest::Client, url: &str) -> String {
    client.get(url).send().await.unwrap().text().await.unwrap()
}

/// The log lines written on this thread while the guard [`capture_logs`] gave with it is held.
#[derive(Clone, Default)]
pub struct CapturedLogs(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for CapturedLogs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl CapturedLogs {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// Captures every crate's log lines at `level` and above written on this thread (a
/// current-thread runtime's tasks included) until the guard drops.
pub fn capture_logs(level: tracing::Level) -> (CapturedLogs, tracing::subscriber::DefaultGuard) {
    let logs = CapturedLogs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    (logs, tracing::subscriber::set_default(subscriber))
}

/// What the proxy does with connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    /// Forward bytes both ways.
    Pass,
    /// Close every connection, open or new: Postgres is unreachable.
    Refuse,
    /// Keep connections open but forward nothing: Postgres is too slow to answer.
    Blackhole,
}

/// A TCP proxy in front of Postgres whose behaviour tests switch, so a test can take "the
/// database" away from one front tier without stopping the server other tests share.
pub struct PgProxy {
    pub address: SocketAddr,
    mode: watch::Sender<ProxyMode>,
    accept_task: tokio::task::JoinHandle<()>,
}

impl PgProxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (mode, _) = watch::channel(ProxyMode::Pass);
        let modes = mode.clone();
        let accept_task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(proxy_connection(client, target, modes.subscribe()));
            }
        });
        Self {
            address,
            mode,
            accept_task,
        }
    }

    pub fn set(&self, mode: ProxyMode) {
        self.mode.send_replace(mode);
    }
}

impl Drop for PgProxy {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

async fn proxy_connection(
    mut client: TcpStream,
    target: SocketAddr,
    mut mode: watch::Receiver<ProxyMode>,
) {
    let current = *mode.borrow_and_update();
    match current {
        ProxyMode::Refuse => {
            let _ = client.shutdown().await;
            return;
        }
        ProxyMode::Blackhole => {
            // Hold the connection, say nothing, until the proxy passes traffic again.
            let _ = mode.wait_for(|m| *m == ProxyMode::Pass).await;
            return;
        }
        ProxyMode::Pass => {}
    }
    let Ok(mut upstream) = TcpStream::connect(target).await else {
        return;
    };
    let went_to = tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => return,
        changed = mode.wait_for(|m| *m != ProxyMode::Pass) => {
            changed.map(|m| *m).unwrap_or(ProxyMode::Refuse)
        }
    };
    drop(upstream);
    if went_to == ProxyMode::Blackhole {
        let _ = mode.wait_for(|m| *m == ProxyMode::Pass).await;
    }
}

// ---- Redis and RabbitMQ, per test -----------------------------------------------------------

pub fn redis_url() -> String {
    std::env::var("RELAY_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// The broker's address, and its URL without a vhost. Override with RELAY_TEST_AMQP_ADDR.
pub fn amqp_addr() -> SocketAddr {
    std::env::var("RELAY_TEST_AMQP_ADDR")
        .unwrap_or_else(|_| "127.0.0.1:5672".to_owned())
        .parse()
        .expect("RELAY_TEST_AMQP_ADDR is host:port")
}

pub fn rabbitmqctl(args: &[&str]) {
    let output = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("the tests need rabbitmqctl (RabbitMQ on this machine)");
    assert!(
        output.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A RabbitMQ vhost that exists for one test; `guest` may use it. Deleted when dropped.
pub struct Vhost {
    pub name: String,
}

impl Vhost {
    /// Creates the vhost on the broker (so not `Default`: it has an effect).
    pub fn create() -> Self {
        let name = format!("relay-test-{}", Uuid::new_v4().simple());
        rabbitmqctl(&["add_vhost", &name]);
        rabbitmqctl(&["set_permissions", "-p", &name, "guest", ".*", ".*", ".*"]);
        Self { name }
    }

    pub fn url(&self) -> String {
        self.url_via(amqp_addr())
    }

    /// The vhost's URL through another address (a proxy in front of the broker).
    pub fn url_via(&self, address: SocketAddr) -> String {
        format!("amqp://guest:guest@{address}/{}", self.name)
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        // Deleting a vhost closes its connections and deletes its queues and exchanges.
        let _ = Command::new("rabbitmqctl")
            .args(["delete_vhost", &self.name])
            .output();
    }
}

/// Deletes the test's Redis keys (leases left by an aborted publisher) when dropped.
pub struct RedisPrefix(pub String);

impl Drop for RedisPrefix {
    fn drop(&mut self) {
        let Ok(client) = redis::Client::open(redis_url()) else {
            return;
        };
        let Ok(mut conn) = client.get_connection() else {
            return;
        };
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.0))
            .query(&mut conn)
            .unwrap_or_default();
        for key in keys {
            let _: Result<i64, _> = redis::cmd("DEL").arg(key).query(&mut conn);
        }
    }
}

pub fn seed() -> u64 {
    std::env::var("RELAY_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random)
}

/// [`seed`], printed for `test` with how to replay it.
pub fn printed_seed(test: &str) -> u64 {
    let seed = seed();
    eprintln!("{test}: seed {seed} (RELAY_TEST_SEED={seed} replays it)");
    seed
}
