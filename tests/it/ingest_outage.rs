//! Postgres unreachable or too slow: the front tier answers 503 with Retry-After inside its
//! deadline, never 2xx for anything it did not commit, and recovers by itself.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_ingest::SystemClock;
use relay_tests::{feed_body, test_config, PgProxy, ProxyMode, Signed, TestApp};
use reqwest::StatusCode;

fn postgres_address() -> SocketAddr {
    "127.0.0.1:5432".parse().unwrap()
}

#[tokio::test]
async fn unreachable_or_silent_postgres_gets_503_with_retry_after_within_the_deadline() {
    let proxy = PgProxy::start(postgres_address()).await;
    let config = test_config();
    let deadline = config.answer_deadline;
    let app = TestApp::spawn_with(config, Arc::new(SystemClock), Some(proxy.address)).await;
    let (endpoint, secret) = app.endpoint().await;
    let secrets = std::slice::from_ref(&secret);

    let before = Signed::new(secrets, feed_body(endpoint, 0));
    assert_eq!(
        app.post(endpoint, &before).await.status(),
        StatusCode::ACCEPTED
    );

    for mode in [ProxyMode::Refuse, ProxyMode::Blackhole] {
        proxy.set(mode);
        let message = Signed::new(secrets, feed_body(endpoint, 1));
        let started = Instant::now();
        let response = app.post(endpoint, &message).await;
        let took = started.elapsed();
        assert_eq!(
            response.status(),
            StatusCode::SERVICE_UNAVAILABLE,
            "{mode:?}"
        );
        assert_eq!(response.headers()["retry-after"], "7", "{mode:?}");
        // Answered by the deadline (plus scheduling slack), far inside the upstream's 15 s.
        assert!(
            took < deadline + Duration::from_secs(2),
            "{mode:?} took {took:?}"
        );
        proxy.set(ProxyMode::Pass);
    }

    // Back: the same message goes through, without restarting anything.
    let after = Signed::new(secrets, feed_body(endpoint, 2));
    let give_up = Instant::now() + Duration::from_secs(20);
    let status = loop {
        let status = app.post(endpoint, &after).await.status();
        if status.is_success() || Instant::now() > give_up {
            break status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(status, StatusCode::ACCEPTED);
    assert!(app.answered("unavailable").await >= 2.0);
    let stored: HashSet<String> = app.stored_webhook_ids(endpoint).await.into_iter().collect();
    assert!(stored.contains(&before.webhook_id) && stored.contains(&after.webhook_id));
    app.stop().await;
}

/// Senders keep posting while the database comes and goes; every message answered 2xx must be
/// stored afterwards, and every 503 must have come with a Retry-After.
#[tokio::test]
async fn every_message_answered_2xx_through_an_outage_is_stored() {
    let proxy = PgProxy::start(postgres_address()).await;
    let app = Arc::new(
        TestApp::spawn_with(test_config(), Arc::new(SystemClock), Some(proxy.address)).await,
    );
    let mut endpoints = Vec::new();
    for _ in 0..4 {
        endpoints.push(app.endpoint().await);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let senders: Vec<_> = (0..8)
        .map(|worker| {
            let (app, stop) = (app.clone(), stop.clone());
            let (endpoint, secret) = endpoints[worker % endpoints.len()].clone();
            tokio::spawn(async move {
                let mut acknowledged = Vec::new();
                let mut refused = 0;
                let mut n = (worker as u64) * 1_000_000;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let message =
                        Signed::new(std::slice::from_ref(&secret), feed_body(endpoint, n));
                    let response = app.post(endpoint, &message).await;
                    match response.status() {
                        s if s.is_success() => acknowledged.push((endpoint, message.webhook_id)),
                        StatusCode::SERVICE_UNAVAILABLE => {
                            assert!(response.headers().contains_key("retry-after"));
                            refused += 1;
                        }
                        other => panic!("unexpected answer {other}"),
                    }
                }
                (acknowledged, refused)
            })
        })
        .collect();

    // Up, refused, up, silent, up: each phase long enough for requests to straddle the switch.
    for (mode, for_ms) in [
        (ProxyMode::Pass, 700),
        (ProxyMode::Refuse, 1_500),
        (ProxyMode::Pass, 1_500),
        (ProxyMode::Blackhole, 2_500),
        (ProxyMode::Pass, 2_000),
    ] {
        proxy.set(mode);
        tokio::time::sleep(Duration::from_millis(for_ms)).await;
    }
    stop.store(true, Ordering::Relaxed);

    let (mut acknowledged, mut refused) = (Vec::new(), 0);
    for sender in senders {
        let (acks, refusals) = sender.await.unwrap();
        acknowledged.extend(acks);
        refused += refusals;
    }
    assert!(refused > 0, "the outage phases refused nothing");
    assert!(
        acknowledged.len() > 20,
        "too little got through: {}",
        acknowledged.len()
    );

    let mut stored = HashSet::new();
    for (endpoint, _) in &endpoints {
        stored.extend(app.stored_webhook_ids(*endpoint).await);
    }
    let lost: Vec<&String> = acknowledged
        .iter()
        .map(|(_, id)| id)
        .filter(|id| !stored.contains(*id))
        .collect();
    assert!(lost.is_empty(), "acknowledged but not stored: {lost:?}");
    eprintln!(
        "{} acknowledged and stored, {refused} answered 503, {} stored in all",
        acknowledged.len(),
        stored.len()
    );
    Arc::into_inner(app).unwrap().stop().await;
}
