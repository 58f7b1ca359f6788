//! The queue follower the demo's consumer and `relay tail` read with: a connection the broker
//! closes (through its management API, as an operator or a password rotation does) is opened
//! again and the deliveries go on; a wrong password or a queue that does not exist ends it at
//! once with the broker's refusal.

use std::time::{Duration, Instant};

use relay_publisher::lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use relay_publisher::lapin::types::FieldTable;
use relay_publisher::lapin::BasicProperties;
use relay_publisher::{QueueFollower, QueueReader};
use relay_tests::Vhost;

use crate::stack::connect_broker;

const MANAGEMENT: &str = "http://127.0.0.1:15672";

/// The name of the broker's connection to `vhost` named `connection_name` by its client, once
/// the management API lists it (its statistics come every few seconds).
async fn connection_named(http: &reqwest::Client, vhost: &str, connection_name: &str) -> String {
    let started = Instant::now();
    loop {
        let all: Vec<serde_json::Value> = http
            .get(format!("{MANAGEMENT}/api/connections"))
            .basic_auth("guest", Some("guest"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let found = all.iter().find(|c| {
            c["vhost"] == vhost && c["client_properties"]["connection_name"] == connection_name
        });
        if let Some(name) = found.and_then(|c| c["name"].as_str()) {
            return name.to_owned();
        }
        // A bound for a connection never listed, not a timing claim.
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no connection {connection_name:?} listed in {vhost}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_connection_is_opened_again_and_a_refusal_ends_the_follower() {
    let vhost = Vhost::create();
    let url = vhost.url();
    let publisher = connect_broker(&url, "queue follower").await;
    let channel = publisher.create_channel().await.unwrap();
    channel
        .queue_declare(
            "followed",
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let publish = |body: &'static [u8]| {
        let channel = channel.clone();
        async move {
            channel
                .basic_publish(
                    "",
                    "followed",
                    BasicPublishOptions::default(),
                    body,
                    BasicProperties::default(),
                )
                .await
                .unwrap()
                .await
                .unwrap();
        }
    };
    let trust = relay_netguard::TrustRoots::platform();
    let reader = QueueReader {
        url: &url,
        name: "follower test",
        tag: "follower-test",
        prefetch: 10,
    };
    let mut follower = QueueFollower::new(reader, "followed", &trust);
    publish(b"one").await;
    let first = follower.next().await.unwrap().unwrap();
    assert_eq!(first.data, b"one");
    first.acker.ack(Default::default()).await.unwrap();

    // The broker closes the follower's connection (the publisher's is left alone).
    let http = reqwest::Client::new();
    let name = connection_named(&http, &vhost.name, "follower test").await;
    let started = Instant::now();
    let closed = http
        .delete(format!(
            "{MANAGEMENT}/api/connections/{}",
            urlencoding(&name)
        ))
        .basic_auth("guest", Some("guest"))
        .send()
        .await
        .unwrap();
    assert!(closed.status().is_success(), "{}", closed.status());
    publish(b"two").await;
    // A bound for a follower that never comes back, not a timing claim.
    let second = tokio::time::timeout(Duration::from_secs(60), follower.next())
        .await
        .expect("the follower came back")
        .unwrap()
        .unwrap();
    assert_eq!(second.data, b"two");
    assert_eq!(
        follower.interruptions.len(),
        1,
        "{:?}",
        follower.interruptions
    );
    assert!(follower.interruptions[0].away_s.is_some());
    eprintln!(
        "follower back after {:?}: {:?}",
        started.elapsed(),
        follower.interruptions
    );
    follower.close("done").await;

    // Refusals end it with the cause: a wrong password, a queue that does not exist.
    let wrong = url.replace("guest:guest", "guest:wrong-password");
    for (url, queue, code) in [(&wrong, "followed", "403"), (&url, "no-such-queue", "404")] {
        let reader = QueueReader {
            url,
            name: "refused test",
            tag: "refused-test",
            prefetch: 10,
        };
        let mut refused = QueueFollower::new(reader, queue, &trust);
        let error = tokio::time::timeout(Duration::from_secs(30), refused.next())
            .await
            .expect("a refusal ends the follower, not a retry loop")
            .expect_err("refused");
        let text = format!("{error:#}");
        assert!(text.contains("refused") && text.contains(code), "{text}");
    }
    let _ = publisher.close(200, "done").await;
}

/// A connection name as one path segment of the management API.
fn urlencoding(name: &str) -> String {
    name.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
