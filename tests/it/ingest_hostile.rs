//! The front tier against hostile input and hostile clients: one tenant's poison messages fail
//! no one else's, a verified body the relay cannot read is kept rather than refused, a body for
//! another endpoint is refused, slow and surplus connections are cut or refused while good
//! messages still get through (on the webhook, control plane and metrics listeners), and
//! unknown endpoint ids cost one database read.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rand::seq::SliceRandom as _;
use rand::{Rng as _, SeedableRng as _};
use rand_chacha::ChaCha8Rng;
use relay_ingest::{BatchWriter, WriteError};
use relay_ingest::{IngestConfig, IngestMetrics, SystemClock};
use relay_listener::ListenerLimits;
use relay_store::messages::{IncomingMessage, StoreOutcome};
use relay_tests::{feed_body, test_config, PgProxy, ProxyMode, Signed, TestApp, TestDb};
use reqwest::StatusCode;
use serde_json::{json, Value};
use time::OffsetDateTime;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use uuid::Uuid;

/// The seed of a test's randomness: RELAY_TEST_SEED to replay one, else a fresh one.
fn seed() -> u64 {
    std::env::var("RELAY_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random)
}

/// Words Postgres uses when it refuses a value; none may reach a client.
const DATABASE_WORDS: [&str; 5] = ["0x00", "UTF8", "invalid byte", "Postgres", "database"];

/// A feed message of `endpoint` spoiled by a control character in one of the identifiers the
/// relay keeps as text, chosen by `rng`.
fn poisoned_body(endpoint: Uuid, n: u64, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let mut message: Value = serde_json::from_slice(&feed_body(endpoint, n)).unwrap();
    message["events"][0]["data"]["parts"] = json!([{"part_id": "p", "part_version": 1}]);
    let bad = ["\u{0}", "\n", "\u{1b}[31m"][rng.gen_range(0..3)];
    let slot = match rng.gen_range(0..4) {
        0 => &mut message["track"],
        1 => &mut message["events"][0]["id"],
        2 => &mut message["events"][0]["subject"],
        _ => &mut message["events"][0]["data"]["parts"][0]["part_id"],
    };
    *slot = json!(format!("{}{bad}x", slot.as_str().unwrap()));
    serde_json::to_vec(&message).unwrap()
}

#[tokio::test]
async fn one_tenants_control_characters_fail_none_of_another_tenants_messages() {
    let seed = seed();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let app = TestApp::spawn().await;
    let (a, a_secret) = app.endpoint().await;
    let (b, b_secret) = app.endpoint().await;
    let mut a_sent = Vec::new();
    let mut b_sent = Vec::new();
    // As the issue found it: 5 rounds of 40 at once, half of them A's poison.
    for round in 0..5u64 {
        let mut sends = Vec::new();
        for i in 0..20u64 {
            let n = round * 100 + i;
            let poison = Signed::new(
                std::slice::from_ref(&a_secret),
                poisoned_body(a, n, &mut rng),
            );
            let good = Signed::new(std::slice::from_ref(&b_secret), feed_body(b, n));
            a_sent.push(poison.webhook_id.clone());
            b_sent.push(good.webhook_id.clone());
            sends.push((a, poison));
            sends.push((b, good));
        }
        sends.shuffle(&mut rng);
        let app = &app;
        let answers =
            futures::future::join_all(sends.iter().map(|(endpoint, message)| async move {
                let response = app.post(endpoint, message).await;
                let status = response.status();
                (*endpoint, status, response.text().await.unwrap())
            }))
            .await;
        for (endpoint, status, text) in answers {
            let answer: Value = serde_json::from_str(&text).unwrap();
            let wanted = if endpoint == b {
                "accepted"
            } else {
                "accepted_unparsed"
            };
            assert_eq!(
                (status, answer["status"].as_str()),
                (StatusCode::ACCEPTED, Some(wanted)),
                "seed {seed}, round {round}: {text}"
            );
            for word in DATABASE_WORDS {
                assert!(!text.contains(word), "seed {seed}: {text}");
            }
        }
    }
    let mut b_stored = app.stored_webhook_ids(b).await;
    b_stored.sort();
    b_sent.sort();
    assert_eq!(b_stored, b_sent, "seed {seed}");
    let a_stored = app.db.stored_messages(a).await;
    assert_eq!(a_stored.len(), a_sent.len(), "seed {seed}");
    assert!(
        a_stored
            .iter()
            .all(|m| m.track.is_none() && m.generation.is_none()),
        "seed {seed}"
    );
    assert_eq!(app.answered("accepted_unparsed").await, 100.0);
    app.stop().await;
}

#[tokio::test]
async fn a_batch_postgres_refuses_is_stored_again_without_the_message_that_broke_it() {
    // Straight to the writer, past the handler's checks: a NUL in a text column is what Postgres
    // refuses, and one must cost only its own request.
    let seed = seed();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let db = TestDb::new().await;
    let tenant = db.tenant().await;
    let endpoint = Uuid::new_v4();
    db.endpoint(tenant, endpoint, &relay_tests::random_secret())
        .await;
    let registry = prometheus::Registry::new();
    let metrics = Arc::new(IngestMetrics::register(&registry).unwrap());
    // One writer, so that what queues while it commits shares its next batch.
    let config = IngestConfig {
        writers: 1,
        ..test_config()
    };
    let (writer, writers) = BatchWriter::start(db.pool.clone(), &config, metrics);
    let poisoned: Vec<usize> = (0..3).map(|_| rng.gen_range(0..60)).collect();
    let message = |n: usize| IncomingMessage {
        endpoint_id: endpoint,
        tenant_id: tenant,
        webhook_id: format!("msg_{n}"),
        signed_at: OffsetDateTime::now_utc(),
        attempt: Some(1),
        received_at: OffsetDateTime::now_utc(),
        track: Some(if poisoned.contains(&n) {
            "feed\u{0}x".to_owned()
        } else {
            "feed".to_owned()
        }),
        generation: Some(1),
        events: Some(1),
        body: feed_body(endpoint, n as u64).into(),
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let results = futures::future::join_all((0..60).map(|n| {
        let writer = writer.clone();
        let message = message(n);
        async move {
            let coming = writer.coming();
            (n, writer.store(message, deadline, coming).await)
        }
    }))
    .await;
    for (n, result) in &results {
        if poisoned.contains(n) {
            assert!(
                matches!(result, Err(WriteError::Failed(_))),
                "seed {seed}: {n}: {result:?}"
            );
        } else {
            assert!(
                matches!(result, Ok(StoreOutcome::Stored { .. })),
                "seed {seed}: {n}: {result:?}"
            );
        }
    }
    let stored = db.stored_messages(endpoint).await;
    let unpoisoned = (0..60).filter(|n| !poisoned.contains(n)).count();
    assert_eq!(stored.len(), unpoisoned, "seed {seed}");
    // Arrival numbers still follow the order the messages were taken, with no gap a failed
    // statement could have left.
    assert!(stored
        .windows(2)
        .all(|w| w[0].arrival_seq < w[1].arrival_seq));
    drop(writer);
    for task in writers {
        task.await.unwrap();
    }
}

#[tokio::test]
async fn a_503_says_the_relay_is_unavailable_and_nothing_of_why() {
    let proxy = PgProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let app = TestApp::spawn_with(test_config(), Arc::new(SystemClock), Some(proxy.address)).await;
    let (endpoint, secret) = app.endpoint().await;
    proxy.set(ProxyMode::Refuse);
    let message = Signed::new(&[secret], feed_body(endpoint, 1));
    let response = app.post(endpoint, &message).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(
        answer,
        json!({"error": "unavailable",
               "detail": "the relay cannot store messages right now; retry later"})
    );
    proxy.set(ProxyMode::Pass);
    app.stop().await;
}

#[tokio::test]
async fn a_verified_body_that_is_not_a_v1_message_is_stored_as_received_and_answered_202() {
    let app = TestApp::spawn().await;
    let (endpoint, secret) = app.endpoint().await;
    let good: Value = serde_json::from_slice(&feed_body(endpoint, 1)).unwrap();
    let with = |change: &dyn Fn(&mut Value)| {
        let mut message = good.clone();
        change(&mut message);
        serde_json::to_vec(&message).unwrap()
    };
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("not JSON", b"{\"v\":1,".to_vec(), "the body is not JSON"),
        (
            "no events",
            serde_json::to_vec(&json!({"v": 1, "webhook_endpoint_id": endpoint})).unwrap(),
            "events is missing",
        ),
        (
            "version 2",
            with(&|m| m["v"] = json!(2)),
            "message version 2 is not one this relay reads",
        ),
        (
            "a generation as text",
            with(&|m| m["generation"] = json!("1")),
            "generation must be a whole number of at least 0",
        ),
        (
            "a generation past a bigint",
            with(&|m| m["generation"] = json!(u64::MAX)),
            "generation must be at most 9223372036854775807",
        ),
        (
            "an unknown data.type on an update",
            with(&|m| m["events"][0]["data"]["type"] = json!("summary")),
            "events[0].data.type must be",
        ),
        (
            "a NUL in the track",
            with(&|m| m["track"] = json!("feed\u{0}x")),
            "track holds a control character (U+0000)",
        ),
        (
            "a NUL in an event id",
            with(&|m| m["events"][0]["id"] = json!("evt\u{0}")),
            "events[0].id holds a control character (U+0000)",
        ),
        (
            "an escape in a subject",
            with(&|m| m["events"][0]["subject"] = json!("announcement:1\u{1b}[2J")),
            "events[0].subject holds a control character (U+001B)",
        ),
        (
            "a part list of the wrong shape",
            with(&|m| m["events"][0]["data"]["parts"] = json!({"p": 1})),
            "events[0].data.parts must be an array",
        ),
    ];
    let mut sent = Vec::new();
    for (case, body, reason) in &cases {
        let message = Signed::new(std::slice::from_ref(&secret), body.clone());
        let response = app.post(endpoint, &message).await;
        assert_eq!(response.status(), StatusCode::ACCEPTED, "{case}");
        let answer: Value = response.json().await.unwrap();
        assert_eq!(answer["status"], "accepted_unparsed", "{case}");
        assert!(
            answer["detail"].as_str().unwrap().contains(reason),
            "{case}: {answer}"
        );
        sent.push((message.webhook_id, body.clone()));
    }
    let stored = app.db.stored_messages(endpoint).await;
    let stored: Vec<_> = stored
        .into_iter()
        .map(|m| {
            (
                m.webhook_id,
                m.body,
                m.track.is_none() && m.generation.is_none(),
            )
        })
        .collect();
    let expected: Vec<_> = sent
        .into_iter()
        .map(|(id, body)| (id, body, true))
        .collect();
    assert_eq!(stored, expected);
    assert_eq!(app.answered("accepted_unparsed").await, cases.len() as f64);
    app.stop().await;
}

#[tokio::test]
async fn a_verified_body_naming_another_endpoint_is_400_and_stores_nothing() {
    let app = TestApp::spawn().await;
    let (endpoint, secret) = app.endpoint().await;
    let elsewhere = Uuid::new_v4();
    let readable = feed_body(elsewhere, 1);
    let unreadable =
        serde_json::to_vec(&json!({"v": 7, "webhook_endpoint_id": elsewhere, "events": "x"}))
            .unwrap();
    for (case, body) in [("readable", readable), ("unreadable", unreadable)] {
        let message = Signed::new(std::slice::from_ref(&secret), body);
        let response = app.post(endpoint, &message).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{case}");
        let answer: Value = response.json().await.unwrap();
        assert_eq!(answer["error"], "endpoint_mismatch", "{case}");
        assert!(
            answer["detail"]
                .as_str()
                .unwrap()
                .contains(&elsewhere.to_string()),
            "{case}"
        );
    }
    // The webhook-id header is still checked, whatever the body.
    let mut long_id = Signed::new(std::slice::from_ref(&secret), feed_body(endpoint, 1));
    long_id.webhook_id = "m".repeat(257);
    long_id.signature = relay_wire::sign(
        &long_id.webhook_id,
        long_id.timestamp,
        &long_id.body,
        std::slice::from_ref(&secret),
    );
    assert_eq!(
        app.post(endpoint, &long_id).await.status(),
        StatusCode::BAD_REQUEST
    );
    assert!(app.stored_webhook_ids(endpoint).await.is_empty());
    assert_eq!(app.answered("endpoint_mismatch").await, 2.0);
    app.stop().await;
}

#[tokio::test]
async fn an_unknown_endpoint_id_costs_one_database_read() {
    let app = TestApp::spawn().await;
    let (_, secret) = app.endpoint().await;
    let front = &app;
    let post_to = |id: Uuid| {
        let message = Signed::new(std::slice::from_ref(&secret), feed_body(id, 1));
        async move { front.post(id, &message).await.status() }
    };
    // Unknown ids are cached once the change listener is up; wait for the first one kept.
    let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
    while app.metric("relay_ingest_endpoint_cache_entries").await == 0.0 {
        assert_eq!(post_to(Uuid::new_v4()).await, StatusCode::NOT_FOUND);
        assert!(
            tokio::time::Instant::now() < give_up,
            "the cache never took an entry"
        );
    }
    let misses = "relay_ingest_endpoint_cache_lookups_total{result=\"miss\"}";
    let before = app.metric(misses).await;
    let unknown = Uuid::new_v4();
    for _ in 0..25 {
        assert_eq!(post_to(unknown).await, StatusCode::NOT_FOUND);
    }
    assert_eq!(app.metric(misses).await, before + 1.0);
    // A path that is no UUID at all costs none.
    for _ in 0..5 {
        assert_eq!(
            app.post("not-a-uuid%0a%1b[31m", &Signed::new(&[], b"{}".to_vec()))
                .await
                .status(),
            StatusCode::NOT_FOUND
        );
    }
    assert_eq!(app.metric(misses).await, before + 1.0);
    app.stop().await;
}

// ---- Slow and surplus connections ------------------------------------------------------------

/// How a trickling connection ended.
#[derive(Debug, PartialEq, Eq)]
enum Trickled {
    /// The server closed it (or answered and closed it).
    ClosedByServer,
    /// Every byte was sent and the connection was still open.
    StillOpen,
}

/// A slowloris client: connects, tells `connected`, then sends a request head one byte each
/// `interval`, never finishing it, for at most `max_bytes` bytes.
async fn trickle(
    address: SocketAddr,
    interval: Duration,
    max_bytes: usize,
    connected: oneshot::Sender<()>,
) -> Trickled {
    let mut stream = TcpStream::connect(address).await.unwrap();
    let _ = connected.send(());
    let head = b"POST /webhooks/00000000-0000-0000-0000-000000000000 HTTP/1.1\r\nx-slow: ";
    let mut bytes = head.iter().copied().chain(std::iter::repeat(b'a'));
    let mut sink = [0u8; 1024];
    for _ in 0..max_bytes {
        if stream.write_all(&[bytes.next().unwrap()]).await.is_err() {
            return Trickled::ClosedByServer;
        }
        // Wait out the interval, watching for the server closing the connection.
        match tokio::time::timeout(interval, stream.read(&mut sink)).await {
            Err(_) => {}
            Ok(Ok(0) | Err(_)) => return Trickled::ClosedByServer,
            Ok(Ok(_)) => {
                // An answer (a refusal): the server closes right after it.
                return Trickled::ClosedByServer;
            }
        }
    }
    Trickled::StillOpen
}

/// Starts `n` trickling connections and returns once all are connected.
async fn trickle_many(
    address: SocketAddr,
    n: usize,
    interval: Duration,
    max_bytes: usize,
) -> Vec<tokio::task::JoinHandle<Trickled>> {
    let mut tasks = Vec::new();
    for _ in 0..n {
        let (connected, is_connected) = oneshot::channel();
        tasks.push(tokio::spawn(trickle(
            address, interval, max_bytes, connected,
        )));
        is_connected.await.unwrap();
    }
    tasks
}

/// A raw HTTP exchange: its status, head and body text.
#[derive(Debug)]
struct RawAnswer {
    status: u16,
    head: String,
    body: String,
}

/// Sends `request` on a new connection and reads until the server closes it.
async fn exchange(address: SocketAddr, request: &[u8]) -> RawAnswer {
    let mut stream = TcpStream::connect(address).await.unwrap();
    // A refused connection may be answered and shut before the request is written.
    let _ = stream.write_all(request).await;
    let mut received = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut received))
        .await
        .expect("the server answers and closes within 30 s");
    let text = String::from_utf8_lossy(&received).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    RawAnswer {
        status,
        head: head.to_ascii_lowercase(),
        body: body.to_owned(),
    }
}

/// A signed webhook request, on a connection to close after it.
fn raw_webhook(endpoint: Uuid, message: &Signed) -> Vec<u8> {
    let mut request = format!(
        "POST /webhooks/{endpoint} HTTP/1.1\r\nhost: relay\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nwebhook-id: {}\r\n\
         webhook-timestamp: {}\r\nwebhook-signature: {}\r\n\r\n",
        message.body.len(),
        message.webhook_id,
        message.timestamp,
        message.signature
    )
    .into_bytes();
    request.extend_from_slice(&message.body);
    request
}

fn assert_refused(answer: &RawAnswer, what: &str) {
    assert_eq!(answer.status, 503, "{what}: {answer:?}");
    assert!(answer.head.contains("retry-after: "), "{what}: {answer:?}");
    assert!(
        answer.head.contains("connection: close"),
        "{what}: {answer:?}"
    );
    let body: Value = serde_json::from_str(&answer.body).unwrap();
    assert_eq!(body["error"], "too_many_connections", "{what}");
}

#[tokio::test]
async fn past_the_connection_bound_slow_clients_are_refused_503_and_good_messages_still_get_in() {
    let config = IngestConfig {
        listener: ListenerLimits {
            header_read_timeout: Duration::from_secs(3),
            body_read_timeout: Duration::from_secs(3),
            max_connections: 8,
            max_headless_per_address: 8,
            ..relay_ingest::LISTENER_LIMITS
        },
        ..test_config()
    };
    let app = TestApp::spawn_with(config, Arc::new(SystemClock), None).await;
    let (endpoint, secret) = app.endpoint().await;
    let address = app.server.as_ref().unwrap().address;
    // One header byte every half second, for at most a minute: the slots are all taken.
    let slow = trickle_many(address, 8, Duration::from_millis(500), 120).await;
    let first = Signed::new(std::slice::from_ref(&secret), feed_body(endpoint, 0));
    assert_refused(
        &exchange(address, &raw_webhook(endpoint, &first)).await,
        "a good message while the slow ones hold every slot",
    );
    // The slow ones are cut at the header read timeout; the upstream's retry then gets in.
    let mut status = 0;
    for _ in 0..200 {
        status = exchange(address, &raw_webhook(endpoint, &first))
            .await
            .status;
        if status != 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(status, 202);
    for task in slow {
        assert_eq!(task.await.unwrap(), Trickled::ClosedByServer);
    }
    assert_eq!(
        app.stored_webhook_ids(endpoint).await,
        vec![first.webhook_id]
    );
    app.stop().await;
}

#[tokio::test]
async fn a_content_length_that_is_not_ascii_digits_is_400_and_stores_nothing() {
    // The handler and the body budget read a declared length as a number when it is one: this
    // is why one that is not never reaches them as if absent.
    let app = TestApp::spawn().await;
    let (endpoint, secret) = app.endpoint().await;
    let address = app.server.as_ref().unwrap().address;
    let message = Signed::new(std::slice::from_ref(&secret), feed_body(endpoint, 0));
    let request = raw_webhook(endpoint, &message);
    let length = format!("content-length: {}\r\n", message.body.len());
    for spoilt in [
        format!("content-length: {}\u{e9}\r\n", message.body.len()).into_bytes(),
        [b"content-length: \xe9".as_slice(), b"\r\n"].concat(),
    ] {
        let at = request
            .windows(length.len())
            .position(|w| w == length.as_bytes())
            .unwrap();
        let mut bad = request[..at].to_vec();
        bad.extend_from_slice(&spoilt);
        bad.extend_from_slice(&request[at + length.len()..]);
        let answer = exchange(address, &bad).await;
        assert_eq!(answer.status, 400, "{answer:?}");
    }
    assert!(app.stored_webhook_ids(endpoint).await.is_empty());
    assert_eq!(exchange(address, &request).await.status, 202);
    app.stop().await;
}

#[tokio::test]
async fn a_head_that_trickles_in_is_cut_at_the_header_read_timeout_and_a_slow_body_is_408() {
    let config = IngestConfig {
        listener: ListenerLimits {
            header_read_timeout: Duration::from_secs(1),
            body_read_timeout: Duration::from_secs(1),
            max_connections: 64,
            max_headless_per_address: 64,
            ..relay_ingest::LISTENER_LIMITS
        },
        ..test_config()
    };
    let app = TestApp::spawn_with(config, Arc::new(SystemClock), None).await;
    let (endpoint, secret) = app.endpoint().await;
    let address = app.server.as_ref().unwrap().address;
    // At most 100 bytes, one each 200 ms: the connection is cut long before the last.
    let slow = trickle_many(address, 4, Duration::from_millis(200), 100).await;
    // Meanwhile good messages are answered as ever.
    let good = Signed::new(std::slice::from_ref(&secret), feed_body(endpoint, 1));
    assert_eq!(
        app.post(endpoint, &good).await.status(),
        StatusCode::ACCEPTED
    );
    for task in slow {
        assert_eq!(task.await.unwrap(), Trickled::ClosedByServer);
    }

    // A head that arrives whole, and then a tenth of the body it announced.
    let message = Signed::new(std::slice::from_ref(&secret), feed_body(endpoint, 2));
    let mut request = raw_webhook(endpoint, &message);
    request.truncate(request.len() - message.body.len() * 9 / 10);
    let answer = exchange(address, &request).await;
    assert_eq!(answer.status, 408, "{answer:?}");
    assert!(answer.head.contains("connection: close"), "{answer:?}");
    let body: Value = serde_json::from_str(&answer.body).unwrap();
    assert_eq!(body["error"], "body_timeout");
    assert_eq!(app.answered("body_timeout").await, 1.0);
    assert_eq!(
        app.stored_webhook_ids(endpoint).await,
        vec![good.webhook_id]
    );
    app.stop().await;
}

#[tokio::test]
async fn the_metrics_listener_has_a_connection_bound_too() {
    let app = TestApp::spawn().await;
    let address = app.server.as_ref().unwrap().metrics_address;
    let limits = ListenerLimits::METRICS;
    let slow = trickle_many(
        address,
        limits.max_connections,
        Duration::from_millis(500),
        120,
    )
    .await;
    let scrape = b"GET /metrics HTTP/1.1\r\nhost: relay\r\nconnection: close\r\n\r\n";
    assert_refused(&exchange(address, scrape).await, "a scrape past the bound");
    for task in slow {
        assert_eq!(task.await.unwrap(), Trickled::ClosedByServer);
    }
    assert_eq!(exchange(address, scrape).await.status, 200);
    app.stop().await;
}

#[tokio::test]
async fn the_control_plane_refuses_past_its_bound_and_cuts_slow_bodies() {
    use relay_api::{mint, JwtKeys, Subject};
    let db = TestDb::new().await;
    let key = b"test-signing-key-of-the-control-plane";
    let mut config = relay_api::ApiConfig::new(JwtKeys::new(key).unwrap(), relay_tests::keys());
    config.listener = ListenerLimits {
        header_read_timeout: Duration::from_secs(2),
        body_read_timeout: Duration::from_secs(1),
        max_connections: 4,
        max_headless_per_address: 4,
        ..ListenerLimits::METRICS
    };
    let server = relay_api::ApiServer::start(db.pool.clone(), config)
        .await
        .unwrap();
    let address = server.address;
    let token = mint(
        &JwtKeys::new(key).unwrap(),
        "relay",
        &Subject::Operator {
            name: "test".into(),
        },
        Duration::from_secs(600),
        OffsetDateTime::now_utc(),
    )
    .unwrap()
    .token;

    let slow = trickle_many(address, 4, Duration::from_millis(500), 120).await;
    let read = b"GET /openapi.json HTTP/1.1\r\nhost: relay\r\nconnection: close\r\n\r\n";
    assert_refused(&exchange(address, read).await, "a request past the bound");
    for task in slow {
        assert_eq!(task.await.unwrap(), Trickled::ClosedByServer);
    }
    assert_eq!(exchange(address, read).await.status, 200);

    let body = br#"{"name": "a tenant whose name never arrives in full"}"#;
    let mut request = format!(
        "POST /v1/tenants HTTP/1.1\r\nhost: relay\r\nconnection: close\r\n\
         authorization: Bearer {token}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(&body[..10]);
    let answer = exchange(address, &request).await;
    assert_eq!(answer.status, 408, "{answer:?}");
    let tenants: i64 = sqlx::query_scalar("SELECT count(*) FROM tenants")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(tenants, 0);
    server.stop().await.unwrap();
}
