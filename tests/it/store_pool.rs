//! The pool every tier uses checks a connection only when it sat idle for a while: a connection
//! the server dropped is found by that check, or else costs the one statement that runs on it,
//! after which the pool opens a new one.

use std::time::Duration;

use relay_store::PoolOptions;
use relay_tests::TestDb;
use sqlx::PgPool;

/// One connection, so every statement runs on the same backend until it is replaced.
fn single_connection_pool(db: &TestDb, check_idle_after: Duration) -> PgPool {
    relay_store::connect(
        &db.url,
        &PoolOptions {
            max_connections: 1,
            acquire_timeout: Duration::from_secs(5),
            check_idle_after,
            ..PoolOptions::default()
        },
    )
    .unwrap()
}

async fn backend_pid(pool: &PgPool) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(pool)
        .await
}

/// Waits until the connection is back in the pool: sqlx checks it on the way back, in a task
/// of its own, and a test that ends the backend before that check would test the check.
async fn returned(pool: &PgPool) {
    let started = std::time::Instant::now();
    while pool.num_idle() < 1 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the connection never came back"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Ends the backend from another connection, as a server restart or an administrator would.
async fn terminate(db: &TestDb, pid: i32) {
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
        .bind(pid)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(ended, "backend {pid} was not terminated");
}

/// A pool of one connection, checked once idle for `idle_check`, whose backend was ended after
/// its first statement, once back in the pool: the database (kept for the pool's life), the
/// pool, and the ended backend's pid.
async fn ended_while_idle(idle_check: Duration) -> (TestDb, PgPool, i32) {
    let db = TestDb::new().await;
    let pool = single_connection_pool(&db, idle_check);
    let first = backend_pid(&pool).await.unwrap();
    returned(&pool).await;
    terminate(&db, first).await;
    (db, pool, first)
}

#[tokio::test]
async fn a_connection_idle_past_the_threshold_is_checked_and_replaced() {
    let (_db, pool, first) = ended_while_idle(Duration::from_millis(50)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    // The check on acquire finds the connection dead: the statement runs on a new one.
    let second = backend_pid(&pool)
        .await
        .expect("the idle check replaces the connection");
    assert_ne!(first, second);
}

#[tokio::test]
async fn a_connection_used_moments_ago_is_not_checked_and_a_dead_one_costs_one_statement() {
    let (_db, pool, first) = ended_while_idle(Duration::from_secs(3600)).await;

    // Not checked: the statement meets the closed connection and fails, as any statement can.
    assert!(backend_pid(&pool).await.is_err());
    // The pool closed that connection as it came back; the next statement gets a new one.
    let second = backend_pid(&pool)
        .await
        .expect("the pool opens a new connection");
    assert_ne!(first, second);
}

#[tokio::test]
async fn work_asked_again_after_a_loss_checks_even_a_connection_used_moments_ago() {
    let (_db, pool, first) = ended_while_idle(Duration::from_secs(3600)).await;
    // As the control plane's second try of a read runs: the dead connection is found by the
    // check and replaced before the statement, which works.
    let second = relay_store::with_every_connection_checked(backend_pid(&pool))
        .await
        .expect("the check replaces the connection");
    assert_ne!(first, second);
    // Outside such work, a connection used moments ago is not checked again.
    assert_eq!(backend_pid(&pool).await.unwrap(), second);
}
