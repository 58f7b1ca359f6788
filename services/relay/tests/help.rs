//! `relay <command> --help`, run as the built binary with passwords in the environment: the
//! help names each setting's variable and never prints its value.

use std::process::Command;

/// Every command path of the binary (`[]`, `["ingest"]`, `["token", "issue"]`, ...).
fn command_paths(command: &clap::Command, prefix: Vec<String>, paths: &mut Vec<Vec<String>>) {
    paths.push(prefix.clone());
    for sub in command.get_subcommands() {
        let mut path = prefix.clone();
        path.push(sub.get_name().to_owned());
        command_paths(sub, path, paths);
    }
}

#[test]
fn no_help_prints_a_secret_from_the_environment() {
    const SECRET: &str = "SECRETPW";
    let mut paths = Vec::new();
    command_paths(&relay::cli::command(), Vec::new(), &mut paths);
    assert!(paths.len() > 10, "{paths:?}");
    for path in paths {
        let output = Command::new(env!("CARGO_BIN_EXE_relay"))
            .args(&path)
            .arg("--help")
            .env("RELAY_DATABASE_URL", format!("postgres://u:{SECRET}@h/db"))
            .env("RELAY_AMQP_URL", format!("amqp://u:{SECRET}@h/%2f"))
            .env("RELAY_REDIS_URL", format!("redis://:{SECRET}@h:6379"))
            .env("RELAY_API_JWT_SECRET", SECRET.repeat(5))
            .env(
                "RELAY_SIMULATE_RECEIVER_URL",
                format!("http://u:{SECRET}@h"),
            )
            .env("RELAY_LOADGEN_URL", format!("http://u:{SECRET}@h"))
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "relay {path:?} --help: {stderr}");
        assert!(
            stdout.contains("RELAY_DATABASE_URL"),
            "relay {path:?} --help names the variables: {stdout}"
        );
        assert!(
            !stdout.contains(SECRET) && !stderr.contains(SECRET),
            "relay {path:?} --help: {stdout}{stderr}"
        );
    }
}
