//! The front tier's resource envelope: what strangers and a hostile tenant can make it hold.
//! Bodies that stop short hold at most the body budget, and one client at most its share; a
//! client's kept-alive connections are bounded whatever they send, and those naming no endpoint
//! are closed after their answer; a tenant's messages past its quota per second are answered
//! 429 with Retry-After and stored only when sent again; a message of more events than the wire
//! allows is stored and never applied; and under a low open-file limit the listener's bound is
//! fitted so that `accept` never fails.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use relay_ingest::{IngestConfig, SystemClock};
use relay_listener::{BodyBudget, ListenerLimits, Shared};
use relay_tests::{feed_body, test_config, Signed, TestApp};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};
use uuid::Uuid;

/// Connects to `to` from `from`, one of this machine's loopback addresses (all of 127/8 is), so
/// each attacker in a test is a client of its own.
pub(crate) async fn connect_from(to: SocketAddr, from: IpAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(from, 0))?;
    socket.connect(to).await
}

/// The resident memory of this process (every tier the test runs is in it), in bytes.
pub(crate) fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().strip_suffix("kB"))
        .and_then(|n| n.trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kib * 1024
}

/// The most this process's resident memory reached while it was being watched (sampled every
/// 20 ms): what another test running beside this one holds counts too, so bounds read from it
/// are generous.
pub(crate) struct ResidentPeak {
    /// Resident memory when the watch began.
    start: u64,
    watching: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
}

impl ResidentPeak {
    pub(crate) fn watch() -> Self {
        let start = resident_bytes();
        let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let going = watching.clone();
        let task = tokio::spawn(async move {
            let mut peak = start;
            while going.load(std::sync::atomic::Ordering::SeqCst) {
                peak = peak.max(resident_bytes());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            peak.max(resident_bytes())
        });
        Self {
            start,
            watching,
            task,
        }
    }

    pub(crate) async fn peak(self) -> u64 {
        self.watching
            .store(false, std::sync::atomic::Ordering::SeqCst);
        self.task.await.unwrap()
    }

    /// How far above its start resident memory went while watched.
    pub(crate) async fn grown(self) -> u64 {
        let start = self.start;
        self.peak().await.saturating_sub(start)
    }
}

/// How a connection that sent a body's head and all but its last byte ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ShortBody {
    /// Answered 503 `body_budget_spent` (refused before or while its body was read).
    Refused,
    /// Answered 408: its body was taken into memory until the read timeout.
    TimedOut,
    /// Answered 503 `too_many_connections`: its client held as many connections as it may.
    ConnectionRefused,
    /// Closed unanswered: refused past the bound while the listener was already writing as
    /// many refusals as it writes at once.
    Dropped,
    /// Answered anything else, or nothing.
    Other,
}

/// A body one byte short of the `length` its head announces, to `endpoint`, from `from`: the
/// head, then everything but the last byte, then a wait for the answer.
pub(crate) async fn short_body(
    to: SocketAddr,
    from: IpAddr,
    endpoint: Uuid,
    body: Arc<Vec<u8>>,
) -> ShortBody {
    let Ok(mut stream) = connect_from(to, from).await else {
        return ShortBody::Other;
    };
    let head = format!(
        "POST /webhooks/{endpoint} HTTP/1.1\r\nhost: relay\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nwebhook-id: msg_short\r\nwebhook-timestamp: 1\r\n\
         webhook-signature: v1,AAAA\r\n\r\n",
        body.len()
    );
    if stream.write_all(head.as_bytes()).await.is_err() {
        return ShortBody::Other;
    }
    // A refused body is answered at once and the connection closed: the write fails then.
    let _ = stream.write_all(&body[..body.len() - 1]).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    if answer.is_empty() {
        ShortBody::Dropped
    } else if answer.starts_with("HTTP/1.1 503") && answer.contains("body_budget_spent") {
        ShortBody::Refused
    } else if answer.starts_with("HTTP/1.1 503") && answer.contains("too_many_connections") {
        ShortBody::ConnectionRefused
    } else if answer.starts_with("HTTP/1.1 408") {
        ShortBody::TimedOut
    } else {
        ShortBody::Other
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_that_stop_short_hold_at_most_the_budget_and_a_clients_share() {
    const MIB: usize = 1024 * 1024;
    let budget = BodyBudget::new(16 * MIB, 4 * MIB);
    let config = IngestConfig {
        answer_deadline: Duration::from_secs(10),
        listener: ListenerLimits {
            body_read_timeout: Duration::from_secs(3),
            ..relay_ingest::LISTENER_LIMITS
        },
        shared: Shared {
            body_budget: budget.clone(),
            ..Shared::default()
        },
        ..test_config()
    };
    let app = TestApp::spawn_with(config, Arc::new(SystemClock), None).await;
    let (a, _) = app.endpoint().await;
    let (b, b_secret) = app.endpoint().await;
    let address = app.server.as_ref().unwrap().address;
    let before = resident_bytes();

    // 300 connections from one stranger, each a 1 MiB body one byte short: unbounded, that held
    // over 1.6 MiB each.
    let stranger: IpAddr = "127.0.0.21".parse().unwrap();
    let body = Arc::new(vec![b'x'; MIB]);
    let attacks: Vec<_> = (0..300)
        .map(|_| tokio::spawn(short_body(address, stranger, a, body.clone())))
        .collect();
    let mut peak_resident = before;
    let mut peak_in_flight = 0;
    let mut b_answers = Vec::new();
    for n in 0..20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        peak_resident = peak_resident.max(resident_bytes());
        peak_in_flight = peak_in_flight.max(budget.in_flight());
        let message = Signed::new(std::slice::from_ref(&b_secret), feed_body(b, n));
        b_answers.push(app.post(b, &message).await.status());
    }
    let mut ends = Vec::new();
    for attack in attacks {
        ends.push(attack.await.unwrap());
    }
    let count = |end| ends.iter().filter(|e| **e == end).count();
    eprintln!(
        "short bodies: {} refused, {} timed out, {} other; resident {} MiB before, peak {} MiB; \
         body bytes in flight at most {} MiB",
        count(ShortBody::Refused),
        count(ShortBody::TimedOut),
        count(ShortBody::Other),
        before / MIB as u64,
        peak_resident / MIB as u64,
        peak_in_flight / MIB
    );
    assert!(
        b_answers.iter().all(|s| *s == StatusCode::ACCEPTED),
        "{b_answers:?}"
    );
    assert!(
        peak_in_flight <= 4 * MIB,
        "the stranger's share: {peak_in_flight}"
    );
    // Refused with a 503, or closed unanswered when the listener was already writing as many
    // refusals as it writes at once: which of the two depends on how busy the machine is.
    assert!(
        count(ShortBody::Refused) + count(ShortBody::Dropped) >= 290,
        "{ends:?}"
    );
    assert_eq!(count(ShortBody::Other), 0, "{ends:?}");
    // The bodies held (the share, twice over for the copy a handler makes) and the connections'
    // buffers, with room for the allocator: far under the 480 MiB 300 such bodies took before.
    let grown = peak_resident.saturating_sub(before);
    assert!(
        grown < (64 * MIB) as u64,
        "resident memory grew by {} MiB",
        grown / MIB as u64
    );
    assert_eq!(budget.in_flight(), 0);
    assert!(app.answered("body_budget_spent").await >= 290.0);
    app.stop().await;
}

/// Sends a request on a kept-alive connection and reads one answer: its status and whether the
/// server closed the connection after it.
pub(crate) async fn keep_alive_exchange(
    stream: &mut TcpStream,
    request: &[u8],
) -> Option<(u16, bool)> {
    stream.write_all(request).await.ok()?;
    let mut answer = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buffer))
            .await
            .ok()?
            .ok()?;
        answer.extend_from_slice(&buffer[..read]);
        let text = String::from_utf8_lossy(&answer).to_ascii_lowercase();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .and_then(|l| l.trim().parse().ok())
                .unwrap_or(0);
            if body.len() >= length || read == 0 {
                let status = head.split(' ').nth(1)?.parse().ok()?;
                return Some((status, head.contains("connection: close")));
            }
        }
        if read == 0 {
            return None;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_clients_kept_alive_connections_cannot_fill_the_listener() {
    let config = IngestConfig {
        listener: ListenerLimits {
            max_connections: 48,
            max_connections_per_client: 16,
            ..relay_ingest::LISTENER_LIMITS
        },
        ..test_config()
    };
    let app = TestApp::spawn_with(config, Arc::new(SystemClock), None).await;
    let (a, _) = app.endpoint().await;
    let (b, b_secret) = app.endpoint().await;
    let address = app.server.as_ref().unwrap().address;
    let stranger: IpAddr = "127.0.0.22".parse().unwrap();

    // Requests naming no endpoint: answered 404 and the connection closed, so they hold nothing.
    let mut unknown = connect_from(address, stranger).await.unwrap();
    let request = format!(
        "POST /webhooks/{} HTTP/1.1\r\nhost: relay\r\ncontent-length: 2\r\n\r\n{{}}",
        Uuid::new_v4()
    );
    assert_eq!(
        keep_alive_exchange(&mut unknown, request.as_bytes()).await,
        Some((404, true))
    );

    // Cheap requests for a known endpoint (unsigned: 401) keep their connections: the stranger
    // holds its share of the listener and no more.
    let request =
        format!("POST /webhooks/{a} HTTP/1.1\r\nhost: relay\r\ncontent-length: 2\r\n\r\n{{}}");
    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..48 {
        let mut stream = connect_from(address, stranger).await.unwrap();
        match keep_alive_exchange(&mut stream, request.as_bytes()).await {
            Some((401, false)) => held.push(stream),
            Some((503, true)) | None => refused += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((held.len(), refused), (16, 32));
    // They keep sending, and another client's messages still get in on new connections.
    for n in 0..20 {
        for stream in held.iter_mut().take(4) {
            assert_eq!(
                keep_alive_exchange(stream, request.as_bytes()).await,
                Some((401, false))
            );
        }
        let message = Signed::new(std::slice::from_ref(&b_secret), feed_body(b, n));
        assert_eq!(app.post(b, &message).await.status(), StatusCode::ACCEPTED);
    }
    assert_eq!(
        app.metric(
            "relay_listener_refused_total{listener=\"webhook\",reason=\"client_connections\"}"
        )
        .await,
        32.0
    );
    app.stop().await;
}

#[tokio::test]
async fn a_tenants_messages_past_its_quota_per_second_are_429_and_stored_when_sent_again() {
    let app = TestApp::spawn().await;
    let (a, a_secret) = app.endpoint().await;
    let (b, b_secret) = app.endpoint().await;
    let tenant_a = app.db.tenant_of(a).await;
    let set = relay_store::quotas::set_overrides(
        &app.db.pool,
        tenant_a,
        &relay_store::quotas::QuotaOverrides {
            messages_per_second: Some(5),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(set);

    let messages: Vec<Signed> = (0..20)
        .map(|n| Signed::new(std::slice::from_ref(&a_secret), feed_body(a, n)))
        .collect();
    let mut throttled = Vec::new();
    let mut accepted = 0usize;
    let mut answered_429 = 0u64;
    for message in &messages {
        let answer = app.post(a, message).await;
        match answer.status() {
            StatusCode::ACCEPTED => accepted += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                answered_429 += 1;
                let retry_after: u64 = answer.headers()["retry-after"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!((1..=2).contains(&retry_after), "{retry_after}");
                let body: Value = answer.json().await.unwrap();
                assert_eq!(body["error"], "rate_limited");
                throttled.push(message);
            }
            other => panic!("{other}"),
        }
        // Another tenant's messages meanwhile: its own quota.
        let message = Signed::new(
            std::slice::from_ref(&b_secret),
            feed_body(b, 100 + answered_429 + accepted as u64),
        );
        assert_eq!(app.post(b, &message).await.status(), StatusCode::ACCEPTED);
    }
    assert!(
        (5..=7).contains(&accepted),
        "a second's worth, give or take the time the loop took: {accepted}"
    );
    assert_eq!(app.stored_webhook_ids(a).await.len(), accepted);
    // Sent again as the upstream does (after Retry-After; a few a second), each is stored.
    for message in &throttled {
        loop {
            match app.post(a, message).await.status() {
                StatusCode::ACCEPTED => break,
                StatusCode::TOO_MANY_REQUESTS => {
                    answered_429 += 1;
                    tokio::time::sleep(Duration::from_millis(250)).await
                }
                other => panic!("{other}"),
            }
        }
    }
    assert_eq!(app.stored_webhook_ids(a).await.len(), 20);
    assert_eq!(app.answered("rate_limited").await as u64, answered_429);
    app.stop().await;
}

#[tokio::test]
async fn a_message_of_more_events_than_the_wire_allows_is_stored_and_not_read() {
    let app = TestApp::spawn().await;
    let (a, secret) = app.endpoint().await;
    let mut message: Value = serde_json::from_slice(&feed_body(a, 1)).unwrap();
    let event = message["events"][0].clone();
    message["events"] = json!(vec![event; relay_wire::limits::MAX_EVENTS + 1]);
    let signed = Signed::new(
        std::slice::from_ref(&secret),
        serde_json::to_vec(&message).unwrap(),
    );
    let answer = app.post(a, &signed).await;
    assert_eq!(answer.status(), StatusCode::ACCEPTED);
    let body: Value = answer.json().await.unwrap();
    assert_eq!(body["status"], "accepted_unparsed", "{body}");
    assert!(
        body["detail"].as_str().unwrap().contains("at most 200"),
        "{body}"
    );
    // Stored with no track: the sequencer sets it aside (sequencer_quarantine).
    let stored = app.db.stored_messages(a).await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].track, None);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_low_open_file_limit_the_bound_fits_and_accept_never_fails() {
    use crate::scale_out::{free_address, TierProcess};
    let db = relay_tests::TestDb::new().await;
    let tenant = db.tenant().await;
    let (b, b_secret) = (Uuid::new_v4(), relay_tests::random_secret());
    db.endpoint(tenant, b, &b_secret).await;
    let (webhook, metrics) = (free_address(), free_address());
    let global = vec!["--database-url".to_owned(), db.url.clone()];
    let ingest = TierProcess::start_limited(
        "ingest",
        &global,
        &["ingest", "--listen", &webhook.to_string()],
        metrics,
        Some(1024),
    );
    let client = reqwest::Client::new();
    ingest.wait_ready(&client).await;
    let bound = ingest
        .metric_sum(
            &client,
            "relay_listener_max_connections{listener=\"webhook\"}",
        )
        .await;
    assert!(
        (1.0..1024.0).contains(&bound),
        "the webhook listener's bound fitted under 1,024 open files: {bound}"
    );

    // 2,000 connections that send a head byte by byte, from eight addresses (so that the
    // bound on each client's connections without a head is not what stops them): twice what
    // the process may open.
    let clients: Vec<IpAddr> = (30..38)
        .map(|i| format!("127.0.0.{i}").parse().unwrap())
        .collect();
    let mut slow = Vec::new();
    for i in 0..2000 {
        let from = clients[i % clients.len()];
        slow.push(tokio::spawn(relay::bench::slow_connection(
            webhook,
            from,
            Duration::from_millis(500),
            Duration::from_secs(4),
        )));
    }
    let mut ends = Vec::new();
    for task in slow {
        ends.push(task.await.unwrap());
    }
    let count = |end| ends.iter().filter(|e| **e == end).count();
    let (refused, closed, open) = (
        count(relay::bench::SlowEnd::Refused),
        count(relay::bench::SlowEnd::Closed),
        count(relay::bench::SlowEnd::StillOpen),
    );
    eprintln!("slow connections: {refused} refused, {closed} closed, {open} open; bound {bound}");
    assert_eq!(
        ingest
            .metric_sum(&client, "relay_listener_accept_failures_total")
            .await,
        0.0,
        "accept failed (EMFILE)"
    );
    assert!(
        refused > 0,
        "past the bound connections are refused: {refused} refused, {closed} closed, {open} open"
    );
    // Once the slow ones are cut, the upstream's messages get in.
    let message = Signed::new(std::slice::from_ref(&b_secret), feed_body(b, 1));
    let mut status = 0;
    for _ in 0..100 {
        let answer = client
            .post(format!("http://{webhook}/webhooks/{b}"))
            .header("webhook-id", &message.webhook_id)
            .header("webhook-timestamp", message.timestamp.to_string())
            .header("webhook-signature", &message.signature)
            .body(message.body.clone())
            .send()
            .await;
        status = answer.map(|a| a.status().as_u16()).unwrap_or(0);
        if status == 202 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(status, 202);
    ingest.kill().await;
}
