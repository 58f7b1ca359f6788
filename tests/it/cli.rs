//! The operator commands, parsed and run exactly as the binary runs them.

use clap::Parser as _;
use relay::cli::{Cli, Command};
use relay_tests::{random_secret, TestDb};
use uuid::Uuid;

async fn run(db: &TestDb, args: &[&str]) -> anyhow::Result<()> {
    let mut argv = vec!["relay", "--database-url", &db.url];
    argv.extend_from_slice(args);
    let cli = Cli::try_parse_from(argv)?;
    match cli.command {
        Command::Tenant(command) => relay::commands::tenant(&cli.global, command).await,
        Command::Endpoint(command) => relay::commands::endpoint(&cli.global, command).await,
        other => panic!("not an operator command: {other:?}"),
    }
}

/// A file holding `text`, removed when dropped.
struct SecretFile(std::path::PathBuf);

impl SecretFile {
    fn as_str(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for SecretFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn secret_file(text: &str) -> SecretFile {
    let path = std::env::temp_dir().join(format!("relay-test-secret-{}", Uuid::new_v4()));
    std::fs::write(&path, text).unwrap();
    SecretFile(path)
}

fn as_strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

async fn status_of(db: &TestDb, endpoint: Uuid) -> String {
    sqlx::query_scalar("SELECT status FROM webhook_endpoints WHERE id = $1")
        .bind(endpoint)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn count(db: &TestDb, sql: &str, id: Uuid) -> i64 {
    sqlx::query_scalar(sql)
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn endpoints_are_added_rotated_paused_and_resumed_from_the_command_line() {
    let db = TestDb::new().await;
    let tenant = Uuid::new_v4();
    let endpoint = Uuid::new_v4();
    run(
        &db,
        &[
            "tenant",
            "add",
            "--name",
            "Acme",
            "--id",
            &tenant.to_string(),
        ],
    )
    .await
    .unwrap();
    let first = secret_file(&format!("{}\n", random_secret().to_whsec()));
    run(
        &db,
        &[
            "endpoint",
            "add",
            "--id",
            &endpoint.to_string(),
            "--tenant",
            &tenant.to_string(),
            "--secret-file",
            first.as_str(),
            "--upstream-base-url",
            "http://127.0.0.1:9700",
        ],
    )
    .await
    .unwrap();
    let auth = relay_store::endpoints::load_auth(&db.pool, endpoint)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(auth.tenant_id, tenant);
    assert_eq!(auth.secrets.len(), 1);

    let second = secret_file(&random_secret().to_whsec());
    run(
        &db,
        &[
            "endpoint",
            "rotate-secret",
            "--id",
            &endpoint.to_string(),
            "--secret-file",
            second.as_str(),
            "--overlap-s",
            "3600",
        ],
    )
    .await
    .unwrap();
    let auth = relay_store::endpoints::load_auth(&db.pool, endpoint)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(auth.secrets.len(), 2);
    assert!(
        auth.secrets[0].expires_at.is_some(),
        "the old secret expires"
    );
    assert!(auth.secrets[1].expires_at.is_none(), "the new one does not");

    run(&db, &["endpoint", "pause", "--id", &endpoint.to_string()])
        .await
        .unwrap();
    assert_eq!(status_of(&db, endpoint).await, "paused");
    run(&db, &["endpoint", "resume", "--id", &endpoint.to_string()])
        .await
        .unwrap();
    assert_eq!(status_of(&db, endpoint).await, "active");
}

#[tokio::test]
async fn bad_input_is_refused_with_a_reason_and_creates_nothing() {
    let db = TestDb::new().await;
    let tenant = Uuid::new_v4();
    run(
        &db,
        &[
            "tenant",
            "add",
            "--name",
            "Acme",
            "--id",
            &tenant.to_string(),
        ],
    )
    .await
    .unwrap();
    let endpoint = Uuid::new_v4();
    let good = secret_file(&random_secret().to_whsec());
    let add = |secret: &str, tenant: Uuid| {
        vec![
            "endpoint".to_owned(),
            "add".into(),
            "--id".into(),
            endpoint.to_string(),
            "--tenant".into(),
            tenant.to_string(),
            "--secret-file".into(),
            secret.to_owned(),
        ]
    };

    let not_a_secret = secret_file("hunter2");
    let error = run(&db, &as_strs(&add(not_a_secret.as_str(), tenant)))
        .await
        .unwrap_err();
    assert!(
        format!("{error:#}").contains("a signing secret starts with `whsec_`"),
        "{error:#}"
    );

    let error = run(&db, &as_strs(&add(good.as_str(), Uuid::new_v4())))
        .await
        .unwrap_err();
    assert!(
        format!("{error:#}").contains("tenant") && format!("{error:#}").contains("does not exist"),
        "{error:#}"
    );

    let error = run(&db, &as_strs(&add("/nonexistent/secret", tenant)))
        .await
        .unwrap_err();
    assert!(
        format!("{error:#}").contains("reading /nonexistent/secret"),
        "{error:#}"
    );

    for table in [
        "SELECT count(*) FROM webhook_endpoints WHERE id = $1",
        "SELECT count(*) FROM endpoint_secrets WHERE endpoint_id = $1",
        "SELECT count(*) FROM endpoint_arrival_counters WHERE endpoint_id = $1",
    ] {
        assert_eq!(count(&db, table, endpoint).await, 0, "{table}");
    }

    run(&db, &as_strs(&add(good.as_str(), tenant)))
        .await
        .unwrap();
    let error = run(&db, &as_strs(&add(good.as_str(), tenant)))
        .await
        .unwrap_err();
    assert!(format!("{error:#}").contains("already exists"), "{error:#}");
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM endpoint_secrets WHERE endpoint_id = $1",
            endpoint
        )
        .await,
        1
    );

    // Rotating to the secret already held, or with an overlap past the upstream's longest.
    let error = run(
        &db,
        &[
            "endpoint",
            "rotate-secret",
            "--id",
            &endpoint.to_string(),
            "--secret-file",
            good.as_str(),
        ],
    )
    .await
    .unwrap_err();
    assert!(format!("{error:#}").contains("already exists"), "{error:#}");
    let error = run(
        &db,
        &[
            "endpoint",
            "rotate-secret",
            "--id",
            &endpoint.to_string(),
            "--secret-file",
            good.as_str(),
            "--overlap-s",
            "604801",
        ],
    )
    .await
    .unwrap_err();
    assert!(format!("{error:#}").contains("604801"), "{error:#}");
    let error = run(
        &db,
        &["endpoint", "pause", "--id", &Uuid::new_v4().to_string()],
    )
    .await
    .unwrap_err();
    assert!(format!("{error:#}").contains("does not exist"), "{error:#}");
}
