//! Finding the writable server among several: a Postgres primary and its standbys, named in one
//! URL as libpq names them (`postgres://user@db-a:5432,db-b:5432/relay`).
//!
//! Every connection is checked to be writable when it opens, as libpq's
//! `target_session_attrs=read-write` does: a server in recovery (a standby, or an old primary
//! that came back as one) is refused, so nothing is ever written to the wrong server and a
//! statement never waits on one that cannot take it. With several servers a watcher per pool
//! keeps one connection to the server in use and asks it each second whether it still takes
//! writes; when it dies or stops taking them, the watcher tries every server in turn, points
//! the pool at the first writable one, and has the pool drop every connection made before the
//! switch. What was not committed when the primary died failed with its connection; each tier
//! already retries a failed statement (the front tier answers 503 and the upstream sends again),
//! so nothing answered 2xx is lost when the standby was synchronous.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

/// How often the watcher asks the server in use whether it still takes writes, and how long
/// a server may take to answer a connect or that question before the next one is tried.
const CHECK_EVERY: Duration = Duration::from_secs(1);
const ANSWER_WITHIN: Duration = Duration::from_secs(2);

/// The servers of a database URL: one URL per host of a libpq-style host list, in order, each
/// with the URL's user, database and parameters. A URL with one host is itself.
/// `target_session_attrs` is taken off: every connection must be writable, whatever it says.
pub fn server_urls(url: &str) -> Vec<String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return vec![url.to_owned()];
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let (user, hosts) = match authority.rsplit_once('@') {
        Some((user, hosts)) => (format!("{user}@"), hosts),
        None => (String::new(), authority),
    };
    let tail = without_parameter(tail, "target_session_attrs");
    hosts
        .split(',')
        .filter(|host| !host.is_empty())
        .map(|host| format!("{scheme}://{user}{host}{tail}"))
        .collect()
}

/// `tail` (a URL's path and query) without the query parameter `name`.
fn without_parameter(tail: &str, name: &str) -> String {
    let Some((path, query)) = tail.split_once('?') else {
        return tail.to_owned();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| pair.split('=').next() != Some(name))
        .collect();
    if kept.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{}", kept.join("&"))
    }
}

/// Whether the server `connection` reaches takes writes (it is not in recovery).
async fn writable(connection: &mut PgConnection) -> Result<bool, sqlx::Error> {
    let (in_recovery,): (bool,) = sqlx::query_as("SELECT pg_is_in_recovery()")
        .fetch_one(connection)
        .await?;
    Ok(!in_recovery)
}

/// Refuses a new connection to a server that does not take writes; `failover`, when there are
/// several servers, is woken to look for the one that does.
pub(crate) async fn check_writable(
    connection: &mut PgConnection,
    failover: Option<&Failover>,
) -> Result<(), sqlx::Error> {
    if writable(connection).await? {
        return Ok(());
    }
    if let Some(failover) = failover {
        failover.wake.notify_one();
    }
    Err(sqlx::Error::Protocol(
        "the server is in recovery (a standby): it does not take writes".to_owned(),
    ))
}

/// Which of several servers a pool connects to, and since when.
pub(crate) struct Failover {
    servers: Vec<PgConnectOptions>,
    current: AtomicUsize,
    switched_at: Mutex<Option<Instant>>,
    wake: tokio::sync::Notify,
}

impl Failover {
    pub(crate) fn new(servers: Vec<PgConnectOptions>) -> Arc<Self> {
        Arc::new(Self {
            servers,
            current: AtomicUsize::new(0),
            switched_at: Mutex::new(None),
            wake: tokio::sync::Notify::new(),
        })
    }

    /// The server a pool connects to first.
    pub(crate) fn first(&self) -> PgConnectOptions {
        self.servers[0].clone()
    }

    /// Whether a connection opened `age` ago predates the last switch (and so may reach the
    /// server the pool left).
    pub(crate) fn predates_switch(&self, age: Duration) -> bool {
        let switched_at = *self.switched_at.lock().expect("not poisoned");
        switched_at.is_some_and(|at| age > at.elapsed())
    }

    /// Starts the watcher for `pool` on the current tokio runtime; it ends when the pool is
    /// closed.
    pub(crate) fn watch(self: &Arc<Self>, pool: &PgPool) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no runtime to watch the database's servers on: the first one is used");
            return;
        };
        runtime.spawn(self.clone().run(pool.clone()));
    }

    async fn run(self: Arc<Self>, pool: PgPool) {
        let mut kept: Option<PgConnection> = None;
        while !pool.is_closed() {
            let still_writable = match kept.as_mut() {
                Some(connection) => matches!(
                    tokio::time::timeout(ANSWER_WITHIN, writable(connection)).await,
                    Ok(Ok(true))
                ),
                None => false,
            };
            if !still_writable {
                if let Some(old) = kept.take() {
                    // Without waiting for a goodbye a dead server would never send.
                    drop(old);
                }
                kept = self.find_writable(&pool).await;
            }
            tokio::select! {
                () = tokio::time::sleep(CHECK_EVERY) => {}
                () = self.wake.notified() => {}
            }
        }
    }

    /// Tries every server from the one in use on; points `pool` at the first that takes
    /// writes, and returns a connection to it for the next checks.
    async fn find_writable(&self, pool: &PgPool) -> Option<PgConnection> {
        let current = self.current.load(Ordering::Relaxed);
        for offset in 0..self.servers.len() {
            let server = (current + offset) % self.servers.len();
            let attempt = async {
                let mut connection = self.servers[server].connect().await?;
                if writable(&mut connection).await? {
                    Ok::<_, sqlx::Error>(Some(connection))
                } else {
                    let _ = connection.close().await;
                    Ok(None)
                }
            };
            let Ok(Ok(Some(connection))) = tokio::time::timeout(ANSWER_WITHIN, attempt).await
            else {
                continue;
            };
            if server != current {
                pool.set_connect_options(self.servers[server].clone());
                *self.switched_at.lock().expect("not poisoned") = Some(Instant::now());
                self.current.store(server, Ordering::Relaxed);
                tracing::warn!(
                    server = server + 1,
                    host = self.servers[server].get_host(),
                    port = self.servers[server].get_port(),
                    "the database moved: writing to another server"
                );
            }
            return Some(connection);
        }
        tracing::warn!(
            servers = self.servers.len(),
            "no database server takes writes"
        );
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_list_gives_one_url_per_server_with_the_same_user_database_and_parameters() {
        assert_eq!(
            server_urls("postgres://relay:pw@db-a:5432,db-b:5433/relay?sslmode=require"),
            [
                "postgres://relay:pw@db-a:5432/relay?sslmode=require",
                "postgres://relay:pw@db-b:5433/relay?sslmode=require"
            ]
        );
        assert_eq!(
            server_urls("postgres://[::1]:5432,10.0.0.2/relay"),
            ["postgres://[::1]:5432/relay", "postgres://10.0.0.2/relay"]
        );
    }

    #[test]
    fn one_host_is_itself_and_target_session_attrs_is_taken_off() {
        assert_eq!(
            server_urls("postgres://postgres@127.0.0.1:5432/relay"),
            ["postgres://postgres@127.0.0.1:5432/relay"]
        );
        assert_eq!(
            server_urls("postgres://u@a,b/d?target_session_attrs=read-write&sslmode=disable"),
            [
                "postgres://u@a/d?sslmode=disable",
                "postgres://u@b/d?sslmode=disable"
            ]
        );
        assert_eq!(
            server_urls("postgres://u@a?target_session_attrs=any"),
            ["postgres://u@a"]
        );
    }
}
