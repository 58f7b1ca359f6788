//! `relay demo`, as the README's first command runs it (in this process, on a vhost and a
//! Redis prefix of the test's own): it must reach a right verdict against the simulator with
//! every fault on, and leave neither its database nor its tenant's broker user behind.

use std::collections::BTreeSet;

use clap::Parser as _;
use relay::cli::{Cli, Command};
use relay_tests::{redis_url, server_url, RedisPrefix, Vhost};
use uuid::Uuid;

async fn demo_databases() -> BTreeSet<String> {
    let pool = sqlx::PgPool::connect(&server_url()).await.unwrap();
    let names: Vec<String> =
        sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'relay\\_demo\\_%'")
            .fetch_all(&pool)
            .await
            .unwrap();
    pool.close().await;
    names.into_iter().collect()
}

fn tenant_users() -> BTreeSet<String> {
    let users = std::process::Command::new("rabbitmqctl")
        .args(["list_users", "--quiet"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&users.stdout)
        .lines()
        .filter(|line| line.starts_with("relay-tenant-"))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_demo_reaches_a_right_verdict_with_every_fault_and_cleans_up() {
    let vhost = tokio::task::spawn_blocking(Vhost::create).await.unwrap();
    let prefix = RedisPrefix(format!("relay-test:{}:", Uuid::new_v4().simple()));
    let (databases, users) = (demo_databases().await, tenant_users());
    let cli = Cli::try_parse_from([
        "relay",
        "--database-url",
        &server_url(),
        "--redis-url",
        &redis_url(),
        "--redis-key-prefix",
        &prefix.0,
        "demo",
        "--duration-s",
        "6",
        "--endpoints",
        "3",
        "--faults",
        "all",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--api-listen",
        "127.0.0.1:0",
        "--amqp-url",
        &vhost.url(),
    ])
    .unwrap();
    let Command::Demo(args) = cli.command else {
        unreachable!("parsed as demo");
    };
    relay::demo::run(&cli.global, *args)
        .await
        .expect("the demo's verdict: every copy is the simulator's truth");
    assert!(
        demo_databases().await.is_subset(&databases),
        "the demo's database is left behind"
    );
    assert!(
        tenant_users().is_subset(&users),
        "the demo's broker user is left behind"
    );
}
