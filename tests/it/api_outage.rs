//! The database going away in the middle of a request: the connection the statement ran on is
//! terminated by the server (what a restart or a failover does to every connection). A read is
//! asked once more on a fresh connection and answers as if nothing happened; when that one is
//! lost too, and for a write, the answer is 503 `unavailable` with Retry-After, never a 500.
//! The front tier answers a message whose connection was lost 503 with Retry-After, and stores
//! it when it comes again.

use std::time::{Duration, Instant};

use relay_tests::{feed_body, Signed, TestApp};
use serde_json::json;
use sqlx::{PgPool, Postgres, Transaction};

use super::ApiApp;
use crate::stack::Answer;

/// Locks `table` against every other session of the test's database until the transaction
/// ends: a statement of the relay that needs it waits, its connection idle in a lock wait.
async fn hold_lock(pool: &PgPool, table: &str) -> Transaction<'static, Postgres> {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&format!("LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

/// Waits until a session of the relay waits on a lock in `database`, then terminates it as a
/// restarting server does ("terminating connection due to administrator command"); its pid.
async fn terminate_waiting(pool: &PgPool, database: &str, not: &[i32]) -> i32 {
    let started = Instant::now();
    loop {
        let pid: Option<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity
             WHERE datname = $1 AND application_name = 'relay' AND wait_event_type = 'Lock'
               AND pid <> ALL($2)
             LIMIT 1",
        )
        .bind(database)
        .bind(not)
        .fetch_optional(pool)
        .await
        .unwrap();
        if let Some(pid) = pid {
            let done: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
                .bind(pid)
                .fetch_one(pool)
                .await
                .unwrap();
            assert!(done, "terminating {pid}");
            return pid;
        }
        // A bound for a statement that never comes, not a timing claim.
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no session of the relay waited on the lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn assert_unavailable(answer: &Answer, what: &str) {
    assert_eq!(answer.status, 503, "{what}: {}", answer.text);
    assert_eq!(
        answer.json["error"], "unavailable",
        "{what}: {}",
        answer.text
    );
    assert_eq!(answer.retry_after.as_deref(), Some("1"), "{what}");
}

// One thread: the captured log sees every task, sqlx's release of connections included.
#[tokio::test]
async fn a_lost_connection_is_a_read_asked_again_or_a_503_with_retry_after() {
    let (logs, _guard) = relay_tests::capture_logs(tracing::Level::INFO);
    let app = ApiApp::spawn().await;
    let (_, token) = app.tenant("outage").await;
    let (endpoint, _) = app.endpoint(&token, json!({})).await;
    let path = format!("/v1/endpoints/{endpoint}");
    let database = app.db.name.clone();

    // Lost once: asked again on a fresh connection, answered 200.
    let lock = hold_lock(&app.db.pool, "webhook_endpoints").await;
    let read = {
        let (app, token, path) = (&app, token.clone(), path.clone());
        async move { app.call("GET", &path, Some(&token), None).await }
    };
    let (answer, ()) = tokio::join!(read, async {
        let first = terminate_waiting(&app.db.pool, &database, &[]).await;
        // The read comes again on another connection and waits on the lock again.
        let started = Instant::now();
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = $1 AND application_name = 'relay'
                   AND wait_event_type = 'Lock' AND pid <> $2",
            )
            .bind(&database)
            .bind(first)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
            if waiting > 0 {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(20), "no second try");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        lock.commit().await.unwrap();
    });
    assert_eq!(answer.status, 200, "{}", answer.text);
    assert_eq!(answer.json["id"], endpoint.to_string());

    // Lost on both tries: 503 with Retry-After.
    let lock = hold_lock(&app.db.pool, "webhook_endpoints").await;
    let read = {
        let (app, token, path) = (&app, token.clone(), path.clone());
        async move { app.call("GET", &path, Some(&token), None).await }
    };
    let (answer, ()) = tokio::join!(read, async {
        let first = terminate_waiting(&app.db.pool, &database, &[]).await;
        terminate_waiting(&app.db.pool, &database, &[first]).await;
    });
    lock.commit().await.unwrap();
    assert_unavailable(&answer, "a read lost twice");

    // A write is not run again: its 503 tells the caller to ask again.
    let lock = hold_lock(&app.db.pool, "webhook_endpoints").await;
    let pause = {
        let (app, token) = (&app, token.clone());
        let path = format!("{path}/pause");
        async move { app.call("POST", &path, Some(&token), None).await }
    };
    let (answer, _) = tokio::join!(pause, terminate_waiting(&app.db.pool, &database, &[]));
    lock.commit().await.unwrap();
    assert_unavailable(&answer, "a write whose connection was lost");
    let read = app.ok(200, "GET", &path, &token, None).await;
    assert_eq!(read["status"], "active", "the pause did not commit");
    app.stop().await;
    let logged = logs.text();
    assert!(
        logged.contains("asking again"),
        "the retry is logged:\n{logged}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_front_tier_answers_a_lost_connection_503_and_stores_the_message_sent_again() {
    let app = TestApp::spawn().await;
    let (endpoint, secret) = app.endpoint().await;
    let database = app.db.name.clone();
    let message = Signed::new(&[secret], feed_body(endpoint, 1));
    // Once the endpoint is cached, the message only needs its insert.
    let warm = Signed::new(&[relay_tests::random_secret()], feed_body(endpoint, 2));
    let _ = app.post(endpoint, &warm).await;

    let lock = hold_lock(&app.db.pool, "messages").await;
    let (answer, _) = tokio::join!(
        app.post(endpoint, &message),
        terminate_waiting(&app.db.pool, &database, &[])
    );
    lock.commit().await.unwrap();
    assert_eq!(answer.status(), 503);
    assert!(answer.headers().contains_key("retry-after"));
    assert!(app.db.stored_messages(endpoint).await.is_empty());

    // The upstream sends it again: stored.
    let again = app.post(endpoint, &message).await;
    assert_eq!(again.status(), 202);
    assert_eq!(app.db.stored_messages(endpoint).await.len(), 1);
}
