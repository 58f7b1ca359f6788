//! Helpers: a small upstream with one company set, keys and endpoints, and a virtual receiver.

use std::collections::BTreeMap;

use relay_simulator::model::{Access, Filter, World};
use relay_simulator::upstream::{Answer, EndpointSpec, Outgoing, SenderConfig, Upstream};
use relay_simulator::workload::companies;
use relay_simulator::Faults;
use relay_wire::SigningSecret;
use uuid::Uuid;

pub const KEY: &str = "qk_test";
pub const WALL: i64 = 1_791_439_212;

pub fn secret() -> SigningSecret {
    SigningSecret::parse("whsec_d2ViaG9vay1leGFtcGxlLXNlY3JldC12MSEh").unwrap()
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
