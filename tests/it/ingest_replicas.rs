//! The front tier is stateless: replicas share one database, and a stopping replica answers
//! what it took in. Randomness is seeded; the seed is printed and can be set with
//! RELAY_TEST_SEED.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::{Rng as _, SeedableRng as _};
use relay_tests::{feed_body, test_config, Signed, TestApp};
use reqwest::StatusCode;
use uuid::Uuid;

fn seed() -> u64 {
    let seed = std::env::var("RELAY_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("seed {seed} (RELAY_TEST_SEED={seed} replays it)");
    seed
}

#[tokio::test]
async fn replicas_share_a_database_without_deadlocks_and_keep_each_senders_order() {
    let seed = seed();
    let app = Arc::new(TestApp::spawn().await);
    let replicas = [
        app.replica(test_config()).await,
        app.replica(test_config()).await,
    ];
    let urls: Arc<Vec<String>> = Arc::new(
        std::iter::once(app.base_url.clone())
            .chain(replicas.iter().map(|r| format!("http://{}", r.address)))
            .collect(),
    );
    let mut endpoints = Vec::new();
    for _ in 0..5 {
        endpoints.push(app.endpoint().await);
    }
    let endpoints = Arc::new(endpoints);

    // Each sender posts its messages one after another, each to a random replica, and some
    // twice at once to two replicas (a retry racing the first attempt).
    let senders: Vec<_> = (0..12u64)
        .map(|sender| {
            let (app, urls, endpoints) = (app.clone(), urls.clone(), endpoints.clone());
            tokio::spawn(async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ sender);
                let mut sent: Vec<(Uuid, String)> = Vec::new();
                for n in 0..40 {
                    let (endpoint, secret) = &endpoints[rng.gen_range(0..endpoints.len())];
                    let message = Signed::new(
                        std::slice::from_ref(secret),
                        feed_body(*endpoint, sender * 1000 + n),
                    );
                    let url = &urls[rng.gen_range(0..urls.len())];
                    if rng.gen_bool(0.2) {
                        let other = &urls[rng.gen_range(0..urls.len())];
                        let (a, b) = tokio::join!(
                            app.try_post_to(url, endpoint, &message),
                            app.try_post_to(other, endpoint, &message)
                        );
                        let mut statuses =
                            [a.unwrap().status().as_u16(), b.unwrap().status().as_u16()];
                        statuses.sort_unstable();
                        // Exactly one attempt stored it; the other was answered as a duplicate.
                        assert_eq!(statuses, [200, 202], "seed {seed}");
                    } else {
                        let status = app
                            .try_post_to(url, endpoint, &message)
                            .await
                            .unwrap()
                            .status();
                        assert_eq!(status.as_u16(), 202, "seed {seed}");
                    }
                    sent.push((*endpoint, message.webhook_id));
                }
                sent
            })
        })
        .collect();
    let mut sent_by_sender = Vec::new();
    for sender in senders {
        sent_by_sender.push(sender.await.unwrap());
    }

    let mut arrival: HashMap<String, i64> = HashMap::new();
    for (endpoint, _) in endpoints.iter() {
        for m in app.db.stored_messages(*endpoint).await {
            assert!(arrival.insert(m.webhook_id, m.arrival_seq).is_none());
        }
    }
    assert_eq!(
        arrival.len(),
        12 * 40,
        "every message stored once (seed {seed})"
    );
    // A sender's messages to one endpoint were each answered before the next was sent, so
    // their arrival numbers rise in the order it sent them.
    for sent in &sent_by_sender {
        let mut last: HashMap<Uuid, i64> = HashMap::new();
        for (endpoint, webhook_id) in sent {
            let seq = arrival[webhook_id];
            if let Some(previous) = last.insert(*endpoint, seq) {
                assert!(previous < seq, "arrival order broken (seed {seed})");
            }
        }
    }
    for replica in replicas {
        replica.stop().await.unwrap();
    }
    Arc::into_inner(app).unwrap().stop().await;
}

#[tokio::test]
async fn a_stopping_front_tier_answers_what_it_took_and_loses_nothing_acknowledged() {
    let mut app = TestApp::spawn().await;
    let server = app.server.take().unwrap();
    let app = Arc::new(app);
    let (endpoint, secret) = app.endpoint().await;
    let stop = Arc::new(AtomicBool::new(false));
    let senders: Vec<_> = (0..16u64)
        .map(|sender| {
            let (app, secret, stop) = (app.clone(), secret.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut acknowledged, mut unanswered) = (Vec::new(), 0);
                let mut n = sender * 1_000_000;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let message =
                        Signed::new(std::slice::from_ref(&secret), feed_body(endpoint, n));
                    match app.try_post_to(&app.base_url, endpoint, &message).await {
                        Ok(response) if response.status().is_success() => {
                            acknowledged.push(message.webhook_id)
                        }
                        // Sixteen senders in a loop can pass the tenant's quota of messages a
                        // second on a fast machine: refused, nothing taken, sent again later.
                        Ok(response) if response.status() == StatusCode::TOO_MANY_REQUESTS => {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        Ok(response) => panic!("unexpected {}", response.status()),
                        // Refused once the listener closed: the sender retries elsewhere.
                        Err(_) => {
                            unanswered += 1;
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                }
                (acknowledged, unanswered)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(400)).await;
    server.stop().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, Ordering::Relaxed);

    let (mut acknowledged, mut unanswered) = (Vec::new(), 0);
    for sender in senders {
        let (acks, misses) = sender.await.unwrap();
        acknowledged.extend(acks);
        unanswered += misses;
    }
    let stored: HashSet<String> = app.stored_webhook_ids(endpoint).await.into_iter().collect();
    assert!(!acknowledged.is_empty());
    assert!(unanswered > 0, "the stop came after every sender finished");
    let lost: Vec<&String> = acknowledged
        .iter()
        .filter(|id| !stored.contains(*id))
        .collect();
    assert!(
        lost.is_empty(),
        "acknowledged, then lost in the stop: {lost:?}"
    );
}
