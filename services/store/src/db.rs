//! Connecting to Postgres, and the read-only snapshot that several reads share.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use sqlx::migrate::Migrator;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool, Postgres, Transaction};

use crate::failover::{check_writable, server_urls, Failover};
use crate::StoreError;

/// The workspace's `migrations/`, compiled in so the binary can migrate with no files beside it.
pub static MIGRATOR: Migrator = sqlx::migrate!("../../migrations");

/// How a tier's pool behaves. Defaults suit one process of each tier on a small machine.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub max_connections: u32,
    /// How long to wait for a free connection (or a new one) before giving up.
    pub acquire_timeout: Duration,
    /// Postgres' own `statement_timeout` on every connection, so a stuck statement ends
    /// server-side too. `None` leaves the server's default.
    pub statement_timeout: Option<Duration>,
    /// Plan each prepared statement once (`plan_cache_mode = force_generic_plan`). For the
    /// front tier's batch insert, Postgres otherwise re-plans the statement on every execution,
    /// which costs twice what running it does.
    pub generic_plans: bool,
    /// A connection that sat idle in the pool for longer than this is checked with a round trip
    /// before it is handed out (Postgres may have restarted, or a firewall dropped the socket).
    /// One used more recently answered moments ago: checking it would only add a round trip to
    /// every statement, which is what sqlx does by default.
    pub check_idle_after: Duration,
    /// The operator's CA file (`RELAY_TLS_CA_FILE`), trusted beside the platform's roots when
    /// the database URL asks for TLS (`sslmode=require`, `verify-ca`, `verify-full`) and names
    /// no `sslrootcert` of its own.
    pub ca_file: Option<PathBuf>,
}

impl Default for PoolOptions {
    fn default() -> Self {
        Self {
            max_connections: 10,
            acquire_timeout: Duration::from_secs(5),
            statement_timeout: Some(Duration::from_secs(10)),
            generic_plans: false,
            check_idle_after: Duration::from_secs(5),
            ca_file: None,
        }
    }
}

/// Opens a pool lazily: no connection is made until the first query, so a tier can start (and
/// answer 503) while Postgres is down, and recovers by itself when it comes back.
///
/// `database_url` may name several servers as libpq does (`postgres://u@db-a,db-b:5433/relay`):
/// a primary and its standbys. Every connection must take writes (see [`crate::failover`]); with
/// several servers the pool follows the primary when a standby is promoted.
///
/// TLS is the URL's `sslmode` (`disable`, `prefer`: sqlx's default, `require`, `verify-ca`,
/// `verify-full`), checked against the platform's roots and `options.ca_file`, unless the URL
/// (or `PGSSLROOTCERT`) names an `sslrootcert`, which is then trusted beside the platform's
/// roots instead.
pub fn connect(database_url: &str, options: &PoolOptions) -> Result<PgPool, sqlx::Error> {
    let servers = server_urls(database_url)
        .iter()
        .map(|url| server_options(url, options))
        .collect::<Result<Vec<_>, _>>()?;
    let failover = (servers.len() > 1).then(|| Failover::new(servers.clone()));
    let first = match &failover {
        Some(failover) => failover.first(),
        None => servers
            .into_iter()
            .next()
            .ok_or_else(|| sqlx::Error::Configuration("the database URL names no host".into()))?,
    };
    let check_idle_after = options.check_idle_after;
    let on_connect = failover.clone();
    let on_acquire = failover.clone();
    let pool = PgPoolOptions::new()
        .max_connections(options.max_connections)
        .acquire_timeout(options.acquire_timeout)
        // sqlx's default pings every connection on every acquire. At a few thousand statements a
        // second that is over a quarter of the round trips to Postgres, each waking a backend and
        // waiting for it. A connection that fails anyway fails its statement, which every caller
        // already handles (and the pool then closes it).
        .test_before_acquire(false)
        .after_connect(move |conn, _meta| {
            let failover = on_connect.clone();
            Box::pin(async move { check_writable(conn, failover.as_deref()).await })
        })
        .before_acquire(move |conn, meta| {
            let failover = on_acquire.clone();
            Box::pin(async move {
                if failover.is_some_and(|failover| failover.predates_switch(meta.age)) {
                    return Ok(false);
                }
                // A request asked again because its connection was lost (a server restarted, a
                // failover) checks every connection it takes, like a long-idle one: the others
                // may have been lost with it.
                if meta.idle_for >= check_idle_after || every_connection_checked() {
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
        .connect_lazy_with(first);
    if let Some(failover) = &failover {
        failover.watch(&pool);
    }
    Ok(pool)
}

/// Whether `error` says the connection to Postgres was lost or could not be made (the server
/// restarting or shutting down, the socket closed, no connection to be had in time), rather than
/// anything about the statement: the same statement may work on a fresh connection
/// ([`with_every_connection_checked`]).
pub fn connection_lost(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            // Class 08: connection exception. 57P01 admin_shutdown, 57P02 crash_shutdown,
            // 57P03 cannot_connect_now (starting or shutting down), 53300 too_many_connections.
            code.starts_with("08") || matches!(&*code, "57P01" | "57P02" | "57P03" | "53300")
        }),
        _ => false,
    }
}

tokio::task_local! {
    /// Set while a piece of work runs again after losing its connection.
    static CHECK_EVERY_CONNECTION: ();
}

/// Runs `work` with every connection it takes from a pool checked with a round trip first, as
/// one idle for long is ([`PoolOptions::check_idle_after`]): for work asked again after its
/// connection was lost ([`connection_lost`]), when the pool's other connections may have been
/// lost with it. Only the connections taken by `work`'s own task are checked.
pub async fn with_every_connection_checked<F: std::future::Future>(work: F) -> F::Output {
    CHECK_EVERY_CONNECTION.scope((), work).await
}

fn every_connection_checked() -> bool {
    CHECK_EVERY_CONNECTION.try_with(|()| ()).is_ok()
}

/// One server's connect options: the URL's, with the operator's CA file and `options`' settings.
fn server_options(url: &str, options: &PoolOptions) -> Result<PgConnectOptions, sqlx::Error> {
    let mut connect: PgConnectOptions = url.parse()?;
    if let Some(ca_file) = &options.ca_file {
        let named = connect
            .to_url_lossy()
            .query_pairs()
            .any(|(key, _)| key == "sslrootcert");
        if !named {
            connect = connect.ssl_root_cert(ca_file);
        }
    }
    connect = connect
        .application_name("relay")
        .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(1));
    if let Some(timeout) = options.statement_timeout {
        connect = connect.options([("statement_timeout", format!("{}", timeout.as_millis()))]);
    }
    if options.generic_plans {
        connect = connect.options([("plan_cache_mode", "force_generic_plan")]);
    }
    Ok(connect)
}

/// A read-only transaction on one snapshot (repeatable read), so that several reads agree with
/// each other.
pub async fn read_snapshot(pool: &PgPool) -> Result<Transaction<'static, Postgres>, StoreError> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await?;
    Ok(tx)
}

/// The connection a loop keeps between statements that follow each other closely.
///
/// Handing a connection back to the pool costs a round trip: sqlx checks every connection it
/// takes back. A loop that runs a statement every few milliseconds (the front tier's batch
/// writers, the sequencer's shared reader) keeps its connection instead, and gives it back
/// after a pause, so that the pool's own check runs before it is used again. A statement that
/// failed takes its connection with it: only connections that just worked are kept.
pub struct KeptConnection {
    pool: PgPool,
    kept: Option<(PoolConnection<Postgres>, Instant)>,
}

impl KeptConnection {
    /// How long after its last statement a connection is still used without a check.
    pub const KEEP_FOR: Duration = Duration::from_secs(1);

    pub fn new(pool: PgPool) -> Self {
        Self { pool, kept: None }
    }

    /// The connection kept from the last statement if it ended less than [`Self::KEEP_FOR`]
    /// ago; otherwise one from the pool (the kept one goes back to it).
    pub async fn take(&mut self) -> Result<PoolConnection<Postgres>, sqlx::Error> {
        match self.kept.take() {
            Some((connection, used_at)) if used_at.elapsed() < Self::KEEP_FOR => Ok(connection),
            _ => self.pool.acquire().await,
        }
    }

    /// Keeps `connection`, whose statement just succeeded, for the next one.
    pub fn keep(&mut self, connection: PoolConnection<Postgres>) {
        self.kept = Some((connection, Instant::now()));
    }
}

/// The tables that grow with traffic, whose size the operator watches (and retention bounds).
pub const GROWING_TABLES: [&str; 7] = [
    "messages",
    "message_applications",
    "changes",
    "applied_events",
    "copy_items",
    "stories",
    "quarantined_messages",
];

/// Each of [`GROWING_TABLES`]' size on disk (with its indexes and TOAST) in bytes, and its row
/// count as the planner last estimated it (`ANALYZE`, autovacuum): cheap enough to read often.
pub async fn table_sizes(pool: &PgPool) -> Result<Vec<(&'static str, i64, f64)>, StoreError> {
    let rows: Vec<(String, i64, f32)> = sqlx::query_as(
        "SELECT c.relname::text, pg_total_relation_size(c.oid), GREATEST(c.reltuples, 0)
         FROM pg_class c
         WHERE c.relname = ANY($1) AND c.relkind = 'r'
           AND c.relnamespace = 'public'::regnamespace",
    )
    .bind(&GROWING_TABLES[..])
    .fetch_all(pool)
    .await?;
    Ok(GROWING_TABLES
        .iter()
        .filter_map(|&table| {
            rows.iter()
                .find(|(name, _, _)| name == table)
                .map(|(_, bytes, rows)| (table, *bytes, f64::from(*rows)))
        })
        .collect())
}

/// A count by minute's rows, each carrying whether the read's bound cut the window short (the
/// same on every row): the counts, and that flag (false when no row came back).
pub(crate) fn counts_by_minute(
    rows: Vec<(time::OffsetDateTime, i64, bool)>,
) -> (Vec<(time::OffsetDateTime, i64)>, bool) {
    let cut = rows.first().is_some_and(|row| row.2);
    (
        rows.into_iter().map(|(minute, n, _)| (minute, n)).collect(),
        cut,
    )
}
