//! Helpers: a small upstream with one company set, keys and endpoints, and a virtual receiver.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use relay_simulator::driver::Simulation;
use relay_simulator::model::{Access, ChangeKind, Filter, World};
use relay_simulator::upstream::{Answer, EndpointSpec, Outgoing, SenderConfig, Upstream};
use relay_simulator::workload::companies;
use relay_simulator::Faults;
use relay_wire::{verify, ItemKind, SignatureHeaders, SigningSecret, VerifyError};
use serde_json::Value;
use uuid::Uuid;

pub const KEY: &str = "qk_test";
pub const WALL: i64 = 1_791_439_212;

pub fn secret() -> SigningSecret {
    SigningSecret::parse("whsec_d2ViaG9vay1leGFtcGxlLXNlY3JldC12MSEh").unwrap()
}

/// Verifies a received webhook's signature headers over `body` against `secrets`, now (a
/// receiver's check, as the relay's front tier makes it).
pub fn verify_received(
    headers: &HeaderMap,
    body: &[u8],
    secrets: &[SigningSecret],
) -> Result<i64, VerifyError> {
    let h = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let signature = SignatureHeaders {
        webhook_id: h("webhook-id"),
        webhook_timestamp: h("webhook-timestamp"),
        webhook_signature: h("webhook-signature"),
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    verify(signature, body, secrets, now)
}

/// An upstream with the workload's companies and one key with full access to all of them.
pub fn upstream(config: SenderConfig) -> Upstream {
    let mut upstream = Upstream::new(World::default(), config, Faults::default(), 42);
    for company in companies() {
        upstream.world.add_company(company);
    }
    let access: BTreeMap<i64, Access> = upstream
        .world
        .companies
        .keys()
        .map(|id| (*id, Access::Full))
        .collect();
    upstream.world.add_key(KEY, access);
    upstream
}

pub fn endpoint(upstream: &mut Upstream, url: &str, initial_reset: bool) -> Uuid {
    upstream.add_endpoint(
        EndpointSpec {
            key_token: KEY.into(),
            lang: "en".into(),
            filter: Filter::default(),
            url: url.into(),
            secrets: vec![secret()],
            id: Some(Uuid::parse_str("8d2f0c39-2b63-4c55-9a8a-3f5b1d7c1e20").unwrap()),
            initial_reset,
        },
        0,
    )
}

/// Sends everything due, answering each with `answer`; returns what was sent.
pub fn drain(
    upstream: &mut Upstream,
    id: Uuid,
    now_ms: u64,
    answer: impl Fn(&Outgoing) -> Answer,
) -> Vec<Outgoing> {
    let mut sent = Vec::new();
    while let Some(out) = upstream.poll_send(id, now_ms, WALL) {
        upstream.on_answer(id, out.serial, answer(&out), now_ms, WALL);
        sent.push(out);
        assert!(sent.len() < 10_000, "the sender does not stop");
    }
    sent
}

pub fn ok(_: &Outgoing) -> Answer {
    Answer::status(200)
}

/// Creates the announcement "item {n}" of company 28 at `1_791_439_200_000 + n` ms.
pub fn create_item(upstream: &mut Upstream, n: i64) {
    upstream
        .create_item(
            ItemKind::Announcement,
            28,
            &format!("item {n}"),
            1_791_439_200_000 + n,
        )
        .unwrap();
}

/// `upstream` driven by a [`Simulation`] whose API listens on a free local port.
pub async fn serve(upstream: Upstream) -> (Arc<Simulation>, SocketAddr) {
    let sim = Simulation::new(upstream, Duration::from_secs(2));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = relay_simulator::api::serve(listener, sim.clone())
        .await
        .unwrap();
    (sim, addr)
}

/// One request, bearing `token` and carrying `body` as JSON where given: the status and text.
pub async fn call(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, String) {
    let mut request = client.request(method, url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

/// Changes the item announcement:88001 by `kind` (of `text`) at `1_791_439_300_000` ms.
pub fn change_item_88001(upstream: &mut Upstream, kind: ChangeKind, text: &str) {
    upstream
        .change_item("announcement:88001", kind, text, 1_791_439_300_000, false)
        .unwrap();
}

/// [`upstream`] with one [`endpoint`] at a URL nothing serves: its messages are taken by
/// [`drain`] (or `poll_send`).
pub fn upstream_with_endpoint(initial_reset: bool) -> (Upstream, Uuid) {
    let mut upstream = upstream(SenderConfig::default());
    let id = endpoint(&mut upstream, "http://x/{id}", initial_reset);
    (upstream, id)
}
