//! Secrets sealed at rest (relay-seal), end to end, against real Postgres: what a backup of a
//! running relay holds, a sealed value moved to another row, a key rotation while messages keep
//! coming, a backup restored with and without its keys, `relay migrate` sealing what an older
//! relay stored in plain text (and what the tables' pages hold after it), and the logs of a
//! whole run.
//!
//! Every secret, key and password the tests choose is drawn from a seeded generator: each test
//! prints its seed, `RELAY_TEST_SEED=<seed>` replays it, and every failure message names it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser as _;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay::cli::{Cli, GlobalArgs};
use relay::startup::IngestServer;
use relay_ingest::SystemClock;
use relay_netguard::OutboundPolicy;
use relay_sequencer::UpstreamClient;
use relay_simulator::model::{Filter, World};
use relay_simulator::{EndpointSpec, Faults, SenderConfig, Simulation, Upstream};
use relay_store::destinations::{self, Destination};
use relay_store::endpoints::{self, NewEndpoint, Registration, Source};
use relay_store::sealing::{self, BROKER_URLS, SIGNING_SECRETS, UPSTREAM_API_KEYS};
use relay_store::{EndpointId, Keyring, StoreError, TenantId};
use relay_tests::{
    capture_logs, feed_body, post_to, printed_seed, start_front_tier, test_config, Signed, TestDb,
    SEAL_KEYS,
};
use relay_wire::SigningSecret;
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::net::TcpListener;
use uuid::Uuid;

use crate::api::ApiApp;
use crate::stack::Api;

// ---- helpers ----------------------------------------------------------------------------------

/// A keyring of `<id>=<base64>` entries, the first current.
fn keyring(entries: &str) -> Keyring {
    Keyring::new(Arc::new(
        relay_seal::LocalKeys::parse(entries).expect("the test's key entries parse"),
    ))
}

/// A key-encryption key's entry `<id>=<base64 of 32 bytes>`, its bytes drawn from `rng`.
fn kek(id: &str, rng: &mut ChaCha8Rng) -> String {
    format!("{id}={}", base64(&rng.gen::<[u8; 32]>(), false))
}

/// A signing secret of 32 bytes drawn from `rng`.
fn secret(rng: &mut ChaCha8Rng) -> SigningSecret {
    SigningSecret::from_bytes(rng.gen::<[u8; 32]>().to_vec()).unwrap()
}

fn uuid(rng: &mut ChaCha8Rng) -> Uuid {
    uuid::Builder::from_random_bytes(rng.gen()).into_uuid()
}

/// `bytes` in base64 with padding (standard alphabet, or the URL-safe one).
fn base64(bytes: &[u8], url_safe: bool) -> String {
    const STANDARD: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let alphabet: Vec<u8> = STANDARD
        .iter()
        .map(|&c| match (c, url_safe) {
            (b'+', true) => b'-',
            (b'/', true) => b'_',
            (c, _) => c,
        })
        .collect();
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(alphabet[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every form in which a value could sit in a dump or a log line: as given, its bytes in
/// standard and URL-safe base64 (unpadded, so the padded forms are found too), in hex (lower
/// and upper case: a bytea holding it shows so), and its raw bytes.
#[derive(Default)]
struct Needles(Vec<(String, Vec<u8>)>);

impl Needles {
    /// A signing secret: its `whsec_` text, and every encoding of its key's bytes.
    fn secret(&mut self, what: &str, secret: &SigningSecret) {
        let whsec = secret.to_whsec();
        assert_eq!(
            whsec,
            format!("whsec_{}", base64(secret.as_bytes(), false)),
            "the test's base64 is the secret's"
        );
        self.push(format!("{what} (whsec_ text)"), whsec.into_bytes());
        self.bytes(what, secret.as_bytes());
    }

    /// A text value (an API key, a password, a URL, a key entry): the text and every encoding
    /// of its bytes.
    fn text(&mut self, what: &str, text: &str) {
        assert!(
            text.len() >= 12,
            "{what} is long enough not to match by chance"
        );
        self.push(format!("{what} (text)"), text.as_bytes().to_vec());
        self.bytes(what, text.as_bytes());
    }

    fn bytes(&mut self, what: &str, bytes: &[u8]) {
        let unpadded = |text: String| text.trim_end_matches('=').to_owned().into_bytes();
        self.push(format!("{what} (base64)"), unpadded(base64(bytes, false)));
        self.push(
            format!("{what} (URL-safe base64)"),
            unpadded(base64(bytes, true)),
        );
        self.push(format!("{what} (hex)"), hex(bytes).into_bytes());
        self.push(
            format!("{what} (HEX)"),
            hex(bytes).to_uppercase().into_bytes(),
        );
        self.push(format!("{what} (raw bytes)"), bytes.to_vec());
    }

    /// A key-encryption key's entry: the entry, its base64 and its raw bytes.
    fn key_entry(&mut self, what: &str, entry: &str) {
        let (_, encoded) = entry.split_once('=').unwrap();
        self.text(&format!("{what} entry"), encoded);
        let mut bytes = Vec::new();
        // Decoded by the test's own means: the raw bytes of the key.
        let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let sextets: Vec<u32> = encoded
            .bytes()
            .filter(|&c| c != b'=')
            .map(|c| alphabet.iter().position(|&a| a == c).unwrap() as u32)
            .collect();
        for group in sextets.chunks(4) {
            let mut n = 0u32;
            for (i, s) in group.iter().enumerate() {
                n |= s << (18 - 6 * i);
            }
            let take = group.len() - 1;
            bytes.extend_from_slice(&n.to_be_bytes()[1..1 + take]);
        }
        assert_eq!(bytes.len(), 32, "{what} is 32 bytes");
        self.bytes(&format!("{what} key"), &bytes);
    }

    fn push(&mut self, what: String, needle: Vec<u8>) {
        self.0.push((what, needle));
    }

    /// Where any needle occurs in `haystack`: what it is and a little of what surrounds it.
    fn found_in(&self, haystack: &[u8]) -> Vec<String> {
        let mut found = Vec::new();
        for (what, needle) in &self.0 {
            if let Some(at) = haystack
                .windows(needle.len())
                .position(|w| w == &needle[..])
            {
                let from = at.saturating_sub(80);
                let to = (at + needle.len() + 80).min(haystack.len());
                let context: String = haystack[from..to]
                    .iter()
                    .map(|&b| {
                        if b == b' ' || b.is_ascii_graphic() {
                            b as char
                        } else {
                            '.'
                        }
                    })
                    .collect();
                found.push(format!("{what} at byte {at}: …{context}…"));
            }
        }
        found
    }
}

/// The process settings of a `relay` command on `database_url` with `keys` as RELAY_SEAL_KEYS
/// (none at all when `None`), parsed as the binary parses its command line.
fn global(database_url: &str, keys: Option<&str>) -> GlobalArgs {
    let mut line: Vec<String> = vec!["relay".into(), "--database-url".into(), database_url.into()];
    if let Some(keys) = keys {
        line.extend(["--seal-keys".to_owned(), keys.to_owned()]);
    }
    line.push("migrate".into());
    let mut cli = Cli::try_parse_from(line).unwrap();
    // Whatever this process's environment holds: the test says which keys there are.
    cli.global.seal.seal_keys_file = None;
    cli.global.seal.seal_keys = keys.map(str::to_owned);
    cli.global
}

/// `relay::keys::opened` for a process on `database_url` given `keys`: the error's text (its
/// whole chain) when refused.
async fn opened(database_url: &str, keys: Option<&str>, pool: &PgPool) -> Result<Keyring, String> {
    relay::keys::opened(&global(database_url, keys), pool)
        .await
        .map_err(|error| format!("{error:#}"))
}

/// A front tier on `database_url` holding `keys`, as `relay ingest` starts it (port 0).
async fn front_tier(database_url: &str, keys: Keyring) -> IngestServer {
    relay_tests::start_front_tier_with_keys(
        database_url,
        test_config(),
        keys,
        Arc::new(SystemClock),
    )
    .await
}

/// Posts the endpoint's message `n` signed with `secret` to the front tier at `base_url`: the
/// answer's status (0: no answer).
async fn post_signed(
    client: &reqwest::Client,
    base_url: &str,
    endpoint: Uuid,
    secret: &SigningSecret,
    n: u64,
) -> (String, u16) {
    let message = Signed::new(std::slice::from_ref(secret), feed_body(endpoint, n));
    let status = post_to(client, base_url, endpoint, &message)
        .await
        .map_or(0, |answer| answer.status().as_u16());
    (message.webhook_id, status)
}

/// The census as `(table.column, key id) → values`.
async fn census_map(pool: &PgPool) -> BTreeMap<(String, Option<String>), i64> {
    sealing::census(pool)
        .await
        .unwrap()
        .counts
        .into_iter()
        .map(|(column, key, n)| ((column, key), n))
        .collect()
}

/// Values still in the plain-text columns.
async fn plaintext_left(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM endpoint_secrets WHERE secret IS NOT NULL)
              + (SELECT count(*) FROM webhook_endpoints WHERE upstream_api_key IS NOT NULL)
              + (SELECT count(*) FROM tenant_destinations WHERE amqp_url IS NOT NULL)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The endpoint's secrets that open under `keys`, as the front tier loads them.
async fn opened_secrets(pool: &PgPool, keys: &Keyring, endpoint: Uuid) -> Vec<SigningSecret> {
    endpoints::load_auth(pool, keys, endpoint)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("endpoint {endpoint} is registered"))
        .secrets
        .into_iter()
        .map(|held| held.secret)
        .collect()
}

/// The endpoint's upstream API key as the sequencer loads it under `keys`.
async fn opened_api_key(pool: &PgPool, keys: &Keyring, endpoint: Uuid) -> Option<String> {
    endpoints::load_registration(pool, keys, EndpointId(endpoint))
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("endpoint {endpoint} is registered"))
        .upstream_api_key
        .map(|key| key.expose().to_owned())
}

/// The tenant's own broker's URL as the publisher loads it under `keys`.
async fn opened_url(pool: &PgPool, keys: &Keyring, tenant: Uuid) -> Result<String, String> {
    match destinations::for_publishing(pool, keys, TenantId(tenant)).await {
        Ok(Destination::OwnExchange { amqp_url, .. }) => Ok(amqp_url.expose().to_owned()),
        Ok(Destination::RelayQueue) => Err("the relay's queue".to_owned()),
        Err(error) => Err(error.to_string()),
    }
}

/// `pg_dump` of the database at `url` in `format` (`plain`, or `custom` uncompressed so its
/// bytes can be searched): the dump's bytes.
async fn pg_dump(url: &str, format: &str) -> Vec<u8> {
    let output = tokio::process::Command::new("pg_dump")
        .args([
            &format!("--format={format}"),
            "--compress=0",
            "--dbname",
            url,
        ])
        .output()
        .await
        .expect("the sealing tests need pg_dump (PostgreSQL's client tools)");
    assert!(
        output.status.success(),
        "pg_dump --format={format}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output.stdout
}

/// The simulator's API on 127.0.0.1, port 0, with one API key: it answers an endpoint's reads
/// only to that key.
struct SimUpstream {
    sim: Arc<Simulation>,
    base_url: String,
    key: String,
}

impl SimUpstream {
    async fn start(key: String) -> Self {
        let mut upstream = Upstream::new(
            World::default(),
            SenderConfig::default(),
            Faults::default(),
            7,
        );
        upstream.world.add_key(&key, BTreeMap::new());
        let sim = Simulation::new(upstream, Duration::from_secs(2));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = relay_simulator::api::serve(listener, sim.clone())
            .await
            .unwrap();
        Self {
            sim,
            base_url: format!("http://{address}"),
            key,
        }
    }

    fn add_endpoint(&self, id: Uuid, secret: &SigningSecret) {
        let spec = EndpointSpec {
            key_token: self.key.clone(),
            lang: "en".into(),
            filter: Filter::default(),
            url: "http://127.0.0.1:9/webhooks/{id}".into(),
            secrets: vec![secret.clone()],
            id: Some(id),
            initial_reset: false,
        };
        self.sim.change(|up, now| up.add_endpoint(spec, now));
    }
}

/// The sequencer's read of the endpoint's selection upstream (`GET /v1/webhook-endpoints/{id}`)
/// through its own client (`relay_sequencer::UpstreamClient`, not a running sequencer), with the
/// base URL and key the endpoint's registration opens to under `keys`: the language read, or
/// why not.
async fn upstream_read(pool: &PgPool, keys: &Keyring, endpoint: Uuid) -> Result<String, String> {
    let registration = endpoints::load_registration(pool, keys, EndpointId(endpoint))
        .await
        .map_err(|e| e.to_string())?
        .ok_or("not registered")?;
    read_with_key(
        registration.upstream_base_url.as_deref(),
        registration.upstream_api_key.as_ref(),
        endpoint,
    )
    .await
}

async fn read_with_key(
    base_url: Option<&str>,
    key: Option<&relay_store::SecretText>,
    endpoint: Uuid,
) -> Result<String, String> {
    let http = UpstreamClient::http_client(
        Duration::from_secs(5),
        OutboundPolicy::ANY,
        &relay_netguard::TrustRoots::platform(),
    );
    let client = UpstreamClient::new(http, base_url, key).map_err(|e| e.to_string())?;
    client
        .selection(EndpointId(endpoint))
        .await
        .map(|selection| selection.lang)
        .map_err(|e| e.to_string())
}

/// Deletes the tenant's user on the relay's broker when dropped (the test deletes it through the
/// API; this is for a test that fails before): broker users outlive a vhost.
struct BrokerUser(String);

impl Drop for BrokerUser {
    fn drop(&mut self) {
        let _ = std::process::Command::new("rabbitmqctl")
            .args(["delete_user", &self.0])
            .output();
    }
}

// ---- 1. a backup of a running relay ---------------------------------------------------------

/// A running relay (the control plane and the front tier) given secrets, upstream API keys and a
/// broker URL with its password through the API, a secret rotated in and broker credentials made
/// and rotated (their password shown once): neither a plain `pg_dump` nor a custom-format one
/// holds any of them in any encoding, nor the key that seals them; and the front tier still
/// verifies messages signed with every secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dump_of_a_running_relay_holds_no_secret() {
    let seed = printed_seed("a_dump_of_a_running_relay_holds_no_secret");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut needles = Needles::default();
    needles.key_entry("the sealing key", SEAL_KEYS);

    let app = ApiApp::spawn_with_vhost().await;
    let (tenant, token) = app.tenant("sealed at rest").await;
    needles.text("the tenant's token", &token);
    let mut endpoints: Vec<(Uuid, Vec<SigningSecret>)> = Vec::new();
    for n in 0..3 {
        let id = uuid(&mut rng);
        let secrets = vec![secret(&mut rng), secret(&mut rng)];
        let api_key = format!("qk_live_{}", hex(&rng.gen::<[u8; 16]>()));
        let created = app
            .ok(
                201,
                "POST",
                "/v1/endpoints",
                &token,
                Some(&json!({
                    "id": id, "lang": "en",
                    "secrets": secrets.iter().map(SigningSecret::to_whsec).collect::<Vec<_>>(),
                    "upstream_base_url": "http://127.0.0.1:9",
                    "upstream_api_key": api_key,
                })),
            )
            .await;
        assert_eq!(created["upstream_api_key_set"], true, "seed {seed}");
        for (k, s) in secrets.iter().enumerate() {
            needles.secret(&format!("endpoint {n}'s secret {k}"), s);
        }
        needles.text(&format!("endpoint {n}'s upstream API key"), &api_key);
        endpoints.push((id, secrets));
    }
    // A secret rotated in on the first endpoint; the two it held keep verifying for the overlap.
    let rotated_in = secret(&mut rng);
    let rotation = app
        .ok(
            200,
            "POST",
            &format!("/v1/endpoints/{}/secrets/rotate", endpoints[0].0),
            &token,
            Some(&json!({"secret": rotated_in.to_whsec(), "overlap_s": 3600})),
        )
        .await;
    assert_eq!(rotation["old_secrets"], 2, "seed {seed}: {rotation}");
    needles.secret("the secret rotated in", &rotated_in);
    endpoints[0].1.push(rotated_in);

    // The tenant's own broker, with a password of its own.
    let password = format!("pw-{}", hex(&rng.gen::<[u8; 12]>()));
    let amqp_url = format!("amqp://tenant-user:{password}@broker.example:5672/%2f");
    let destination = app
        .ok(
            200,
            "PUT",
            "/v1/destination",
            &token,
            Some(&json!({"kind": "own_exchange", "amqp_url": amqp_url,
                         "exchange": "changes", "routing_key": "copy"})),
        )
        .await;
    assert_eq!(destination["amqp_url_set"], true, "seed {seed}");
    needles.text("the destination's password", &password);
    needles.text("the destination's URL", &amqp_url);

    // Broker credentials on the relay's broker: the password is generated and shown once, and
    // again once rotated.
    let _user = BrokerUser(relay_api::BrokerAccess::username(TenantId(tenant)));
    let made = app
        .ok(201, "POST", "/v1/broker/credentials", &token, None)
        .await;
    let rotated = app
        .ok(200, "POST", "/v1/broker/credentials/rotate", &token, None)
        .await;
    let made_password = made["password"].as_str().expect("shown once").to_owned();
    let rotated_password = rotated["password"].as_str().expect("shown once").to_owned();
    assert_ne!(made_password, rotated_password, "seed {seed}");
    needles.text("the broker password made", &made_password);
    needles.text("the broker password rotated to", &rotated_password);

    // The front tier on the same database verifies each secret; a forged one is refused.
    let ingest = start_front_tier(&app.db.url, test_config(), Arc::new(SystemClock)).await;
    let (client, base_url) = (reqwest::Client::new(), format!("http://{}", ingest.address));
    let mut accepted = Vec::new();
    for (endpoint, secrets) in &endpoints {
        for (k, s) in secrets.iter().enumerate() {
            let (webhook_id, status) =
                post_signed(&client, &base_url, *endpoint, s, k as u64 + 1).await;
            assert_eq!(
                status, 202,
                "seed {seed}: endpoint {endpoint}'s secret {k} verifies"
            );
            accepted.push(webhook_id);
        }
    }
    let forged = secret(&mut rng);
    let (_, status) = post_signed(&client, &base_url, endpoints[1].0, &forged, 99).await;
    assert_eq!(status, 401, "seed {seed}: a forged signature is refused");
    let stored: i64 =
        sqlx::query_scalar("SELECT count(*) FROM messages WHERE webhook_id = ANY($1)")
            .bind(&accepted)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
    assert_eq!(stored, accepted.len() as i64, "seed {seed}");

    // What the database holds: sealed values only, every one under the tests' key.
    assert_eq!(plaintext_left(&app.db.pool).await, 0, "seed {seed}");
    let key = Some("test-2026".to_owned());
    assert_eq!(
        census_map(&app.db.pool).await,
        BTreeMap::from([
            ((SIGNING_SECRETS.field.to_owned(), key.clone()), 7),
            ((UPSTREAM_API_KEYS.field.to_owned(), key.clone()), 3),
            ((BROKER_URLS.field.to_owned(), key), 1),
        ]),
        "seed {seed}"
    );

    // Backups taken while the relay runs.
    for format in ["plain", "custom"] {
        let dump = pg_dump(&app.db.url, format).await;
        assert!(
            dump.windows(b"endpoint_secrets".len())
                .any(|w| w == b"endpoint_secrets")
                && dump
                    .windows(accepted[0].len())
                    .any(|w| w == accepted[0].as_bytes()),
            "seed {seed}: the {format} dump holds the tables and the messages"
        );
        let found = needles.found_in(&dump);
        assert!(
            found.is_empty(),
            "seed {seed}: the {format} dump of a running relay holds secrets:\n{}",
            found.join("\n")
        );
    }

    let deleted = app
        .call("DELETE", "/v1/broker/credentials", Some(&token), None)
        .await;
    assert_eq!(deleted.status, 204, "seed {seed}: {}", deleted.text);
    ingest.stop().await.unwrap();
    app.stop().await;
}

// ---- 2. a sealed value moved to another row -------------------------------------------------

/// A sealed value is bound to its row: copied with SQL into another endpoint's row (a secret, an
/// upstream API key) or another tenant's (a broker URL), or into another column, it opens there
/// for no one. The front tier refuses the first endpoint's signature on the second's URL, the
/// sequencer reads no key, the publisher is refused the URL, and a re-seal and the start-up
/// check name the column and the row.
#[tokio::test]
async fn a_sealed_value_moved_to_another_row_does_not_open() {
    let seed = printed_seed("a_sealed_value_moved_to_another_row_does_not_open");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let db = TestDb::new().await;
    let keys = relay_tests::keys();
    let tenant = db.tenant().await;
    let (a, b, c) = (uuid(&mut rng), uuid(&mut rng), uuid(&mut rng));
    let secrets: BTreeMap<Uuid, SigningSecret> = [a, b, c]
        .into_iter()
        .map(|id| (id, secret(&mut rng)))
        .collect();
    let api_keys: BTreeMap<Uuid, String> = [a, b, c]
        .into_iter()
        .map(|id| (id, format!("qk_{}", hex(&rng.gen::<[u8; 16]>()))))
        .collect();
    for id in [a, b, c] {
        endpoints::create(
            &db.pool,
            &keys,
            &NewEndpoint {
                id,
                tenant_id: tenant,
                secret: secrets[&id].clone(),
                upstream_base_url: Some("http://127.0.0.1:9".into()),
                upstream_api_key: Some(api_keys[&id].as_str().into()),
            },
        )
        .await
        .unwrap();
    }
    for id in [a, b, c] {
        assert_eq!(
            opened_secrets(&db.pool, &keys, id).await,
            vec![secrets[&id].clone()],
            "seed {seed}"
        );
        assert_eq!(
            opened_api_key(&db.pool, &keys, id).await.as_ref(),
            Some(&api_keys[&id]),
            "seed {seed}"
        );
    }

    // A's sealed secret and API key, with their key ids, copied into B's rows.
    sqlx::query(
        "UPDATE endpoint_secrets t SET secret_sealed = a.secret_sealed, secret_key_id = a.secret_key_id
         FROM (SELECT secret_sealed, secret_key_id FROM endpoint_secrets WHERE endpoint_id = $1) a
         WHERE t.endpoint_id = $2",
    )
    .bind(a)
    .bind(b)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE webhook_endpoints t
         SET upstream_api_key_sealed = a.upstream_api_key_sealed,
             upstream_api_key_key_id = a.upstream_api_key_key_id
         FROM (SELECT upstream_api_key_sealed, upstream_api_key_key_id
               FROM webhook_endpoints WHERE id = $1) a
         WHERE t.id = $2",
    )
    .bind(a)
    .bind(b)
    .execute(&db.pool)
    .await
    .unwrap();
    // C's own API key, sealed for webhook_endpoints.upstream_api_key, copied into C's secret.
    sqlx::query(
        "UPDATE endpoint_secrets t SET secret_sealed = e.upstream_api_key_sealed,
                                       secret_key_id = e.upstream_api_key_key_id
         FROM webhook_endpoints e WHERE e.id = $1 AND t.endpoint_id = $1",
    )
    .bind(c)
    .execute(&db.pool)
    .await
    .unwrap();
    let same: bool = sqlx::query_scalar(
        "SELECT (SELECT secret_sealed FROM endpoint_secrets WHERE endpoint_id = $1)
              = (SELECT secret_sealed FROM endpoint_secrets WHERE endpoint_id = $2)
            AND (SELECT upstream_api_key_sealed FROM webhook_endpoints WHERE id = $1)
              = (SELECT upstream_api_key_sealed FROM webhook_endpoints WHERE id = $2)",
    )
    .bind(a)
    .bind(b)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(same, "seed {seed}: B's row holds A's sealed bytes");

    // The front tier's load: B holds no secret (A's least of all), C none; A keeps its own.
    let b_opened = opened_secrets(&db.pool, &keys, b).await;
    assert!(
        !b_opened.contains(&secrets[&a]),
        "seed {seed}: A's secret moved into B's row opens for B"
    );
    assert!(b_opened.is_empty(), "seed {seed}: B's moved value opens");
    assert!(
        opened_secrets(&db.pool, &keys, c).await.is_empty(),
        "seed {seed}: an API key moved into the secrets column opens as a secret"
    );
    assert_eq!(
        opened_secrets(&db.pool, &keys, a).await,
        vec![secrets[&a].clone()],
        "seed {seed}"
    );
    // The sequencer's load: B has no key (as if none were set), A keeps its own.
    assert_eq!(
        opened_api_key(&db.pool, &keys, b).await,
        None,
        "seed {seed}: A's API key moved into B's row opens for B"
    );
    assert_eq!(
        opened_api_key(&db.pool, &keys, a).await.as_ref(),
        Some(&api_keys[&a]),
        "seed {seed}"
    );

    // A front tier: A's signature on B's URL is refused, as is B's own (its row holds A's
    // value now); A's on A's URL is taken.
    let ingest = start_front_tier(&db.url, test_config(), Arc::new(SystemClock)).await;
    let (client, base_url) = (reqwest::Client::new(), format!("http://{}", ingest.address));
    let (_, a_on_b) = post_signed(&client, &base_url, b, &secrets[&a], 1).await;
    assert_eq!(a_on_b, 401, "seed {seed}: A's signature on B's URL");
    let (_, b_on_b) = post_signed(&client, &base_url, b, &secrets[&b], 2).await;
    assert_eq!(
        b_on_b, 401,
        "seed {seed}: B's old secret is gone from its row"
    );
    let (_, a_on_a) = post_signed(&client, &base_url, a, &secrets[&a], 3).await;
    assert_eq!(a_on_a, 202, "seed {seed}: A's own secret still verifies");
    assert!(db.stored_messages(b).await.is_empty(), "seed {seed}");
    ingest.stop().await.unwrap();

    // Two tenants' own brokers; the first's sealed URL copied into the second's row.
    let (t1, t2) = (db.tenant().await, db.tenant().await);
    let mut urls = BTreeMap::new();
    for t in [t1, t2] {
        let url = format!(
            "amqp://u:pw{}@broker-{}.example:5672/%2f",
            hex(&rng.gen::<[u8; 12]>()),
            hex(&rng.gen::<[u8; 4]>())
        );
        destinations::set(
            &db.pool,
            &keys,
            TenantId(t),
            &Destination::OwnExchange {
                amqp_url: url.as_str().into(),
                exchange: "x".into(),
                routing_key: "k".into(),
            },
        )
        .await
        .unwrap();
        assert_eq!(opened_url(&db.pool, &keys, t).await, Ok(url.clone()));
        urls.insert(t, url);
    }
    sqlx::query(
        "UPDATE tenant_destinations t
         SET amqp_url_sealed = s.amqp_url_sealed, amqp_url_key_id = s.amqp_url_key_id
         FROM (SELECT amqp_url_sealed, amqp_url_key_id FROM tenant_destinations
               WHERE tenant_id = $1) s
         WHERE t.tenant_id = $2",
    )
    .bind(t1)
    .bind(t2)
    .execute(&db.pool)
    .await
    .unwrap();
    let refused = opened_url(&db.pool, &keys, t2)
        .await
        .expect_err("T1's broker URL moved into T2's row opens for T2");
    assert!(
        refused.contains(&t2.to_string()) && refused.contains("does not open"),
        "seed {seed}: the publisher's refusal names the tenant: {refused}"
    );
    assert_eq!(
        opened_url(&db.pool, &keys, t1).await,
        Ok(urls[&t1].clone()),
        "seed {seed}"
    );

    // Every error here must name the row, and none may carry a value.
    let mut needles = Needles::default();
    for (id, s) in &secrets {
        needles.secret(&format!("{id}'s secret"), s);
    }
    for (id, key) in &api_keys {
        needles.text(&format!("{id}'s API key"), key);
    }
    for (t, url) in &urls {
        needles.text(&format!("{t}'s broker URL"), url);
    }
    let clean = |error: &str| {
        let found = needles.found_in(error.as_bytes());
        assert!(
            found.is_empty(),
            "seed {seed}: an error shows a value: {error}\n{}",
            found.join("\n")
        );
    };
    clean(&refused);

    // A rotation to a new key re-seals nothing, stopping at the moved value with its row.
    let next = kek("k-next", &mut rng);
    let rotating = keyring(&format!("{next}\n{SEAL_KEYS}"));
    let before = census_map(&db.pool).await;
    let cases = [
        (SIGNING_SECRETS, vec![b, c]),
        (UPSTREAM_API_KEYS, vec![b]),
        (BROKER_URLS, vec![t2]),
    ];
    for (column, moved) in cases {
        let error = sealing::reseal(&db.pool, &rotating, column)
            .await
            .expect_err("a moved value is not re-sealed")
            .to_string();
        assert!(
            moved
                .iter()
                .any(|row| error.contains(&format!("{} of {row}", column.field))),
            "seed {seed}: the re-seal of {} names a moved row ({moved:?}): {error}",
            column.field
        );
        clean(&error);
    }
    let error = relay::keys::rotate(&db.pool, &rotating, Duration::ZERO)
        .await
        .expect_err("a rotation over a moved value stops");
    clean(&format!("{error:#}"));
    assert_eq!(
        census_map(&db.pool).await,
        before,
        "seed {seed}: a failed re-seal writes nothing"
    );

    // The start-up check opens one value under each key: with only moved values left, it is one
    // of them, and start-up is refused naming the column and the row.
    sqlx::query("DELETE FROM webhook_endpoints WHERE id = $1")
        .bind(a)
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM endpoint_secrets WHERE endpoint_id = $1")
        .bind(c)
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE webhook_endpoints SET upstream_api_key_sealed = NULL,
                                      upstream_api_key_key_id = NULL
         WHERE id = $1",
    )
    .bind(c)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("DELETE FROM tenant_destinations WHERE tenant_id = $1")
        .bind(t1)
        .execute(&db.pool)
        .await
        .unwrap();
    let error = sealing::check_keys_open(&db.pool, &keys)
        .await
        .expect_err("the start-up check opens a moved value");
    assert!(
        error.contains(&format!("{} of {b}", SIGNING_SECRETS.field)),
        "seed {seed}: the start-up check names the moved secret's row: {error}"
    );
    clean(&error);
    let refused = opened(&db.url, Some(SEAL_KEYS), &db.pool)
        .await
        .expect_err("a tier does not start over a moved value");
    assert!(
        refused.contains("do not open") && refused.contains(&b.to_string()),
        "seed {seed}: {refused}"
    );
    // B's key alone, then T2's URL alone.
    sqlx::query("DELETE FROM endpoint_secrets WHERE endpoint_id = $1")
        .bind(b)
        .execute(&db.pool)
        .await
        .unwrap();
    let error = sealing::check_keys_open(&db.pool, &keys).await.unwrap_err();
    assert!(
        error.contains(&format!("{} of {b}", UPSTREAM_API_KEYS.field)),
        "seed {seed}: {error}"
    );
    sqlx::query("DELETE FROM webhook_endpoints WHERE id = $1")
        .bind(b)
        .execute(&db.pool)
        .await
        .unwrap();
    let error = sealing::check_keys_open(&db.pool, &keys).await.unwrap_err();
    assert!(
        error.contains(&format!("{} of {t2}", BROKER_URLS.field)),
        "seed {seed}: {error}"
    );
    clean(&error);
}

// ---- 3. a rotation while messages keep coming -------------------------------------------------

/// One message the traffic sent: its endpoint, id, answer and when it was answered.
struct Sent {
    endpoint: Uuid,
    webhook_id: String,
    status: u16,
    at: Instant,
}

/// The operator's rotation from k1 to k2 while the relay runs: every value sealed under k1, the
/// front tier given [k2 current, k1 readable] taking a steady stream of signed messages (its
/// cache reloading the secrets as each batch of the rotation rewrites them), upstream reads
/// going on as the sequencer makes them (its registration load and `UpstreamClient`), and
/// `relay keys rotate` (`relay::keys::rotate`) re-sealing in several batches meanwhile.
/// Every message is answered 202 and stored, every upstream read succeeds; afterwards nothing is
/// left under k1, a process given only k2 opens every value (and reads upstream with the right
/// key), and one given only k1 is refused naming k2.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rotation_under_traffic_loses_and_refuses_nothing() {
    const TENANTS: usize = 6;
    const ENDPOINTS: usize = 300;
    let seed = printed_seed("rotation_under_traffic_loses_and_refuses_nothing");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let db = TestDb::new().await;
    let (k1, k2) = (kek("k1", &mut rng), kek("k2", &mut rng));
    let old = keyring(&k1);
    let both_entries = format!("{k2},{k1}");
    let new = keyring(&k2);

    // The upstream answers reads of the first few endpoints with its key.
    let upstream = SimUpstream::start(format!("qk_sim_{}", hex(&rng.gen::<[u8; 16]>()))).await;
    let tenants: Vec<Uuid> = (0..TENANTS).map(|_| uuid(&mut rng)).collect();
    for &t in &tenants {
        relay_store::tenants::create(&db.pool, t, "rotating")
            .await
            .unwrap();
    }
    struct Registered {
        id: Uuid,
        tenant: Uuid,
        secrets: [SigningSecret; 2],
        api_key: String,
    }
    let mut registered: Vec<Registered> = Vec::new();
    for n in 0..ENDPOINTS {
        let id = uuid(&mut rng);
        let secrets = [secret(&mut rng), secret(&mut rng)];
        let api_key = if n < 4 {
            upstream.add_endpoint(id, &secrets[0]);
            upstream.key.clone()
        } else {
            format!("qk_{n}_{}", hex(&rng.gen::<[u8; 12]>()))
        };
        registered.push(Registered {
            id,
            tenant: tenants[n % TENANTS],
            secrets,
            api_key,
        });
    }
    let sim_endpoints: Vec<Uuid> = registered[..4].iter().map(|r| r.id).collect();
    for chunk in registered.chunks(25) {
        let writes = chunk.iter().map(|r| {
            let (pool, old) = (db.pool.clone(), old.clone());
            let registration = Registration {
                id: EndpointId(r.id),
                name: None,
                source: Source::Feed,
                lang: Some("en".into()),
                upstream_base_url: Some(upstream.base_url.clone()),
                upstream_api_key: Some(r.api_key.as_str().into()),
                secrets: r.secrets.to_vec(),
            };
            let tenant = TenantId(r.tenant);
            async move { endpoints::register(&pool, &old, tenant, &registration).await }
        });
        for written in futures::future::join_all(writes).await {
            written.unwrap();
        }
    }
    let mut urls = BTreeMap::new();
    for &t in &tenants {
        let url = format!(
            "amqp://t:pw{}@broker.example:5672/%2f",
            hex(&rng.gen::<[u8; 12]>())
        );
        destinations::set(
            &db.pool,
            &old,
            TenantId(t),
            &Destination::OwnExchange {
                amqp_url: url.as_str().into(),
                exchange: "x".into(),
                routing_key: "k".into(),
            },
        )
        .await
        .unwrap();
        urls.insert(t, url);
    }
    let total = (2 * ENDPOINTS + ENDPOINTS + TENANTS) as i64;
    let k1_id = Some("k1".to_owned());
    assert_eq!(
        census_map(&db.pool).await,
        BTreeMap::from([
            (
                (SIGNING_SECRETS.field.to_owned(), k1_id.clone()),
                2 * ENDPOINTS as i64
            ),
            (
                (UPSTREAM_API_KEYS.field.to_owned(), k1_id.clone()),
                ENDPOINTS as i64
            ),
            ((BROKER_URLS.field.to_owned(), k1_id), TENANTS as i64),
        ]),
        "seed {seed}"
    );
    assert!(
        2 * ENDPOINTS as i64 > sealing::BATCH,
        "the secrets take more than one batch"
    );

    // Every tier is restarted with [k2, k1]: they open what k1 sealed.
    let tier_keys = opened(&db.url, Some(&both_entries), &db.pool)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: a tier given [k2, k1] starts: {e}"));
    assert_eq!(tier_keys.current().as_str(), "k2");
    let ingest = front_tier(&db.url, tier_keys.clone()).await;
    let base_url = format!("http://{}", ingest.address);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();

    // The traffic: senders posting signed messages to endpoints drawn at random, each signed
    // with one of its two secrets, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let registered = Arc::new(registered);
    let mut senders = Vec::new();
    for s in 0..4u64 {
        let (stop, registered, client, base_url) = (
            stop.clone(),
            registered.clone(),
            client.clone(),
            base_url.clone(),
        );
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (s + 1));
        senders.push(tokio::spawn(async move {
            let mut sent = Vec::new();
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let r = &registered[rng.gen_range(0..registered.len())];
                let secret = &r.secrets[rng.gen_range(0..2)];
                n += 1;
                let (webhook_id, status) =
                    post_signed(&client, &base_url, r.id, secret, s * 1_000_000 + n).await;
                sent.push(Sent {
                    endpoint: r.id,
                    webhook_id,
                    status,
                    at: Instant::now(),
                });
            }
            sent
        }));
    }
    // The sequencer's upstream reads, with the keys its registrations open to under [k2, k1].
    let reader = {
        let (stop, pool, keys, ids) = (
            stop.clone(),
            db.pool.clone(),
            tier_keys.clone(),
            sim_endpoints.clone(),
        );
        tokio::spawn(async move {
            let (mut reads, mut failures) = (0u64, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                for &id in &ids {
                    match upstream_read(&pool, &keys, id).await {
                        Ok(lang) if lang == "en" => reads += 1,
                        other => failures.push(format!("{id}: {other:?}")),
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (reads, failures)
        })
    };

    tokio::time::sleep(Duration::from_millis(500)).await;
    let rotation_began = Instant::now();
    let resealed = relay::keys::rotate(&db.pool, &tier_keys, Duration::from_millis(200))
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: the rotation: {e:#}"));
    let rotation_ended = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let mut sent: Vec<Sent> = Vec::new();
    for sender in senders {
        sent.extend(sender.await.unwrap());
    }
    let (reads, read_failures) = reader.await.unwrap();

    let during = sent
        .iter()
        .filter(|m| m.at > rotation_began && m.at < rotation_ended)
        .count();
    eprintln!(
        "rotation_under_traffic: {} messages, {during} of them during the rotation's {:?}; \
         {reads} upstream reads",
        sent.len(),
        rotation_ended - rotation_began
    );
    assert_eq!(resealed as i64, total, "seed {seed}: every value re-sealed");
    assert!(
        during >= 20,
        "seed {seed}: the traffic ran through the rotation ({during} messages during its {:?})",
        rotation_ended - rotation_began
    );
    let refused: Vec<String> = sent
        .iter()
        .filter(|m| m.status != 202)
        .take(10)
        .map(|m| format!("{} to {}: {}", m.webhook_id, m.endpoint, m.status))
        .collect();
    assert!(
        refused.is_empty(),
        "seed {seed}: messages answered other than 202 during the rotation (of {}):\n{}",
        sent.len(),
        refused.join("\n")
    );
    let ids: Vec<String> = sent.iter().map(|m| m.webhook_id.clone()).collect();
    let stored: BTreeSet<(Uuid, String)> = sqlx::query_as::<_, (Uuid, String)>(
        "SELECT endpoint_id, webhook_id FROM messages WHERE webhook_id = ANY($1)",
    )
    .bind(&ids)
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let expected: BTreeSet<(Uuid, String)> = sent
        .iter()
        .map(|m| (m.endpoint, m.webhook_id.clone()))
        .collect();
    assert_eq!(
        stored.len(),
        expected.len(),
        "seed {seed}: every message answered 202 is stored"
    );
    assert_eq!(stored, expected, "seed {seed}");
    assert!(
        read_failures.is_empty() && reads > 0,
        "seed {seed}: upstream reads during the rotation ({reads} succeeded) failed: {:?}",
        &read_failures[..read_failures.len().min(5)]
    );

    // Nothing is left under k1.
    let census = sealing::census(&db.pool).await.unwrap();
    assert_eq!(census.under_old_keys("k2"), 0, "seed {seed}: {census:?}");
    assert_eq!(census.plaintext(), 0, "seed {seed}");
    let k2_id = Some("k2".to_owned());
    assert_eq!(
        census_map(&db.pool).await,
        BTreeMap::from([
            (
                (SIGNING_SECRETS.field.to_owned(), k2_id.clone()),
                2 * ENDPOINTS as i64
            ),
            (
                (UPSTREAM_API_KEYS.field.to_owned(), k2_id.clone()),
                ENDPOINTS as i64
            ),
            ((BROKER_URLS.field.to_owned(), k2_id), TENANTS as i64),
        ]),
        "seed {seed}"
    );

    // k1 may go: a process given only k2 starts and opens every value.
    sealing::check_keys_open(&db.pool, &new)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: k2 alone: {e}"));
    opened(&db.url, Some(&k2), &db.pool)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: a tier given only k2 starts: {e}"));
    for r in registered.iter() {
        let mut got = opened_secrets(&db.pool, &new, r.id).await;
        got.sort_by(|x, y| x.as_bytes().cmp(y.as_bytes()));
        let mut want = r.secrets.to_vec();
        want.sort_by(|x, y| x.as_bytes().cmp(y.as_bytes()));
        assert!(got == want, "seed {seed}: {}'s secrets under k2", r.id);
        assert_eq!(
            opened_api_key(&db.pool, &new, r.id).await.as_ref(),
            Some(&r.api_key),
            "seed {seed}: {}'s upstream key under k2",
            r.id
        );
    }
    for (t, url) in &urls {
        assert_eq!(
            opened_url(&db.pool, &new, *t).await.as_ref(),
            Ok(url),
            "seed {seed}"
        );
    }
    // The sequencer reads upstream with the key only k2 opens now; a wrong key is refused
    // there, so the read proves the key.
    for &id in &sim_endpoints {
        assert_eq!(
            upstream_read(&db.pool, &new, id).await,
            Ok("en".to_owned()),
            "seed {seed}: reading {id} upstream with k2 alone"
        );
    }
    let wrong = relay_store::SecretText::new(&registered[5].api_key);
    assert!(
        read_with_key(Some(&upstream.base_url), Some(&wrong), sim_endpoints[0])
            .await
            .is_err(),
        "seed {seed}: the upstream takes any key"
    );
    // A front tier given only k2 verifies both secrets.
    let ingest_k2 = front_tier(&db.url, new.clone()).await;
    let k2_url = format!("http://{}", ingest_k2.address);
    for (i, r) in registered.iter().step_by(37).enumerate() {
        for (k, s) in r.secrets.iter().enumerate() {
            let (_, status) = post_signed(
                &client,
                &k2_url,
                r.id,
                s,
                9_000_000 + 2 * i as u64 + k as u64,
            )
            .await;
            assert_eq!(
                status, 202,
                "seed {seed}: {}'s secret {k} under k2 alone",
                r.id
            );
        }
    }

    // A process given only k1 is refused, naming k2 and what it seals.
    let refusal = opened(&db.url, Some(&k1), &db.pool)
        .await
        .expect_err("a tier given only k1 starts");
    assert!(
        refusal.contains(&format!("key `k2` seals {total} value(s)")),
        "seed {seed}: {refusal}"
    );
    let census = sealing::census(&db.pool).await.unwrap();
    let by_old = old
        .census_refusal(&census)
        .expect("k1 alone is refused by the census");
    assert!(by_old.contains("key `k2`"), "seed {seed}: {by_old}");

    ingest_k2.stop().await.unwrap();
    ingest.stop().await.unwrap();
}

// ---- 4. a backup restored with and without its keys ------------------------------------------

/// A backup (`pg_dump -Fc`, `pg_restore` into a fresh database) opens with the keys it was
/// sealed under and with nothing else: without keys the tier says what to set, with another
/// key it names the missing key and how many values it seals, with a key of the same id but
/// other bytes it says the key does not open them.
#[tokio::test]
async fn a_backup_restores_with_its_keys_and_is_refused_clearly_without_them() {
    let seed = printed_seed("a_backup_restores_with_its_keys_and_is_refused_clearly_without_them");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let db = TestDb::new().await;
    let b1 = kek("b1", &mut rng);
    let keys = keyring(&b1);
    let tenant = db.tenant().await;
    let mut registered: Vec<(Uuid, Vec<SigningSecret>, String)> = Vec::new();
    for n in 0..3 {
        let id = uuid(&mut rng);
        let secrets: Vec<SigningSecret> = (0..=n.min(1)).map(|_| secret(&mut rng)).collect();
        let api_key = format!("qk_{}", hex(&rng.gen::<[u8; 16]>()));
        endpoints::register(
            &db.pool,
            &keys,
            TenantId(tenant),
            &Registration {
                id: EndpointId(id),
                name: None,
                source: Source::Feed,
                lang: Some("en".into()),
                upstream_base_url: Some("http://127.0.0.1:9".into()),
                upstream_api_key: Some(api_key.as_str().into()),
                secrets: secrets.clone(),
            },
        )
        .await
        .unwrap();
        registered.push((id, secrets, api_key));
    }
    let url = format!(
        "amqp://t:pw{}@broker.example:5672/%2f",
        hex(&rng.gen::<[u8; 12]>())
    );
    destinations::set(
        &db.pool,
        &keys,
        TenantId(tenant),
        &Destination::OwnExchange {
            amqp_url: url.as_str().into(),
            exchange: "x".into(),
            routing_key: "k".into(),
        },
    )
    .await
    .unwrap();

    let archive = db.dump().await;
    let restored = TestDb::restored(&archive).await;
    let pool = &restored.pool;

    // With its keys: the tiers start and every value opens.
    let opened_keys = opened(&restored.url, Some(&b1), pool)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: the backup's own key: {e}"));
    for (id, secrets, api_key) in &registered {
        assert_eq!(
            &opened_secrets(pool, &opened_keys, *id).await,
            secrets,
            "seed {seed}"
        );
        assert_eq!(
            opened_api_key(pool, &opened_keys, *id).await.as_ref(),
            Some(api_key),
            "seed {seed}"
        );
    }
    assert_eq!(
        opened_url(pool, &opened_keys, tenant).await,
        Ok(url.clone()),
        "seed {seed}"
    );
    let ingest = front_tier(&restored.url, opened_keys).await;
    let (client, base_url) = (reqwest::Client::new(), format!("http://{}", ingest.address));
    let (_, status) =
        post_signed(&client, &base_url, registered[2].0, &registered[2].1[1], 1).await;
    assert_eq!(status, 202, "seed {seed}: the restored relay verifies");
    ingest.stop().await.unwrap();

    let mut needles = Needles::default();
    needles.key_entry("b1", &b1);
    for (id, secrets, api_key) in &registered {
        for s in secrets {
            needles.secret(&format!("{id}'s secret"), s);
        }
        needles.text(&format!("{id}'s API key"), api_key);
    }
    needles.text("the broker URL", &url);
    let clean = |refusal: &str| {
        let found = needles.found_in(refusal.as_bytes());
        assert!(
            found.is_empty(),
            "seed {seed}: {refusal}\n{}",
            found.join("\n")
        );
    };

    // Without keys: what to set.
    let refusal = opened(&restored.url, None, pool)
        .await
        .expect_err("a tier starts without keys");
    assert!(
        refusal.contains("RELAY_SEAL_KEYS_FILE") && refusal.contains("RELAY_SEAL_KEYS"),
        "seed {seed}: {refusal}"
    );
    clean(&refusal);

    // Another key, under another id: the missing key, and how much it seals where.
    let b2 = kek("b2", &mut rng);
    let refusal = opened(&restored.url, Some(&b2), pool)
        .await
        .expect_err("a tier starts with another key");
    assert!(
        refusal.contains(
            "key `b1` seals 9 value(s) (endpoint_secrets.secret: 5, \
             tenant_destinations.amqp_url: 1, webhook_endpoints.upstream_api_key: 3) \
             but is not configured"
        ),
        "seed {seed}: {refusal}"
    );
    clean(&refusal);

    // The same id with other bytes: the key does not open them.
    let impostor = format!("b1={}", base64(&rng.gen::<[u8; 32]>(), false));
    let refusal = opened(&restored.url, Some(&impostor), pool)
        .await
        .expect_err("a tier starts with b1's id but other bytes");
    assert!(
        refusal.contains("do not open the stored secrets")
            && refusal.contains("does not open under key `b1`")
            && refusal.contains("bytes differ"),
        "seed {seed}: {refusal}"
    );
    clean(&refusal);
    // Nor does the impostor open any value in the course of business.
    let impostor = keyring(&impostor);
    for (id, ..) in &registered {
        assert!(
            opened_secrets(pool, &impostor, *id).await.is_empty(),
            "seed {seed}"
        );
        assert_eq!(opened_api_key(pool, &impostor, *id).await, None);
    }
    assert!(opened_url(pool, &impostor, tenant).await.is_err());
}

// ---- 5. relay migrate seals what an older relay stored in plain text --------------------------

/// A database an older relay wrote, its secrets, upstream API keys and broker URLs in plain
/// text (more secrets than one batch seals): a tier refuses to start over it, saying to run
/// `relay migrate`; `relay migrate` without keys fails saying what to set and seals nothing;
/// with keys it seals every value and empties every plain-text column, and the sealed values
/// are the ones stored (the front tier verifies with them, the sequencer reads the key, the
/// publisher the URL, and a secret given again is recognised by its fingerprint).
#[tokio::test]
async fn migrate_seals_what_an_older_relay_stored_in_plain_text() {
    const ENDPOINTS: usize = 260;
    let seed = printed_seed("migrate_seals_what_an_older_relay_stored_in_plain_text");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let db = TestDb::new().await;
    let m1 = kek("m1", &mut rng);
    let keys = keyring(&m1);

    let tenants: Vec<Uuid> = (0..4).map(|_| uuid(&mut rng)).collect();
    for &t in &tenants {
        sqlx::query("INSERT INTO tenants (id, name) VALUES ($1, 'legacy')")
            .bind(t)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    // Endpoints with two secrets each and an upstream key, the last without a key.
    let mut legacy: Vec<(Uuid, Uuid, [SigningSecret; 2], Option<String>)> = Vec::new();
    for n in 0..ENDPOINTS {
        let key = (n + 1 < ENDPOINTS).then(|| format!("qk_plain_{}", hex(&rng.gen::<[u8; 12]>())));
        legacy.push((
            uuid(&mut rng),
            tenants[n % tenants.len()],
            [secret(&mut rng), secret(&mut rng)],
            key,
        ));
    }
    let ids: Vec<Uuid> = legacy.iter().map(|l| l.0).collect();
    let owners: Vec<Uuid> = legacy.iter().map(|l| l.1).collect();
    let api_keys: Vec<Option<String>> = legacy.iter().map(|l| l.3.clone()).collect();
    sqlx::query(
        "INSERT INTO webhook_endpoints (id, tenant_id, lang, upstream_base_url, upstream_api_key)
         SELECT id, tenant_id, 'en', 'http://127.0.0.1:9', key
         FROM unnest($1::uuid[], $2::uuid[], $3::text[]) AS u(id, tenant_id, key)",
    )
    .bind(&ids)
    .bind(&owners)
    .bind(&api_keys)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO endpoint_arrival_counters (endpoint_id) SELECT unnest($1::uuid[])")
        .bind(&ids)
        .execute(&db.pool)
        .await
        .unwrap();
    let (mut secret_rows, mut secret_owners, mut secret_texts) = (vec![], vec![], vec![]);
    for (id, tenant, secrets, _) in &legacy {
        for s in secrets {
            secret_rows.push(*id);
            secret_owners.push(*tenant);
            secret_texts.push(s.to_whsec());
        }
    }
    sqlx::query(
        "INSERT INTO endpoint_secrets (tenant_id, endpoint_id, secret)
         SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[])",
    )
    .bind(&secret_owners)
    .bind(&secret_rows)
    .bind(&secret_texts)
    .execute(&db.pool)
    .await
    .unwrap();
    // Three tenants' own brokers in plain text; the fourth sends to the relay's queue.
    let mut urls = BTreeMap::new();
    for &t in &tenants[..3] {
        let url = format!(
            "amqp://legacy:pw{}@broker.example:5672/%2f",
            hex(&rng.gen::<[u8; 12]>())
        );
        sqlx::query(
            "INSERT INTO tenant_destinations (tenant_id, kind, amqp_url, exchange, routing_key)
             VALUES ($1, 'own_exchange', $2, 'legacy-exchange', 'legacy-key')",
        )
        .bind(t)
        .bind(&url)
        .execute(&db.pool)
        .await
        .unwrap();
        urls.insert(t, url);
    }
    sqlx::query("INSERT INTO tenant_destinations (tenant_id, kind) VALUES ($1, 'relay_queue')")
        .bind(tenants[3])
        .execute(&db.pool)
        .await
        .unwrap();
    // And one endpoint the relay sealed already.
    let sealed_id = uuid(&mut rng);
    let sealed_secret = secret(&mut rng);
    endpoints::create(
        &db.pool,
        &keys,
        &NewEndpoint {
            id: sealed_id,
            tenant_id: tenants[0],
            secret: sealed_secret.clone(),
            upstream_base_url: None,
            upstream_api_key: None,
        },
    )
    .await
    .unwrap();
    let plain = (2 * ENDPOINTS + (ENDPOINTS - 1) + 3) as i64;
    assert_eq!(plaintext_left(&db.pool).await, plain);
    assert!(2 * ENDPOINTS as i64 > sealing::BATCH);

    // A tier refuses to start, keys or not, pointing at `relay migrate`.
    let refusal = opened(&db.url, Some(&m1), &db.pool)
        .await
        .expect_err("a tier starts over plain text");
    assert!(
        refusal.contains(&format!("{plain} secret(s) are stored in plain text"))
            && refusal.contains("relay migrate"),
        "seed {seed}: {refusal}"
    );

    // `relay migrate` without keys: what to set, and nothing sealed.
    let error = relay::commands::migrate(&global(&db.url, None))
        .await
        .expect_err("migrate seals without keys");
    let error = format!("{error:#}");
    assert!(
        error.contains(&format!("{plain} secret(s) are stored in plain text"))
            && error.contains("RELAY_SEAL_KEYS_FILE")
            && error.contains("RELAY_SEAL_KEYS"),
        "seed {seed}: {error}"
    );
    assert_eq!(plaintext_left(&db.pool).await, plain, "seed {seed}");

    // With keys: every value sealed under the current key, no plain text left.
    relay::commands::migrate(&global(&db.url, Some(&m1)))
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: migrate with keys: {e:#}"));
    assert_eq!(plaintext_left(&db.pool).await, 0, "seed {seed}");
    let m1_id = Some("m1".to_owned());
    assert_eq!(
        census_map(&db.pool).await,
        BTreeMap::from([
            (
                (SIGNING_SECRETS.field.to_owned(), m1_id.clone()),
                2 * ENDPOINTS as i64 + 1
            ),
            (
                (UPSTREAM_API_KEYS.field.to_owned(), m1_id.clone()),
                ENDPOINTS as i64 - 1
            ),
            ((BROKER_URLS.field.to_owned(), m1_id), 3),
        ]),
        "seed {seed}"
    );
    let unfingerprinted: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM endpoint_secrets WHERE secret_fingerprint IS NULL
                                                  OR secret_key_id IS DISTINCT FROM 'm1'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(unfingerprinted, 0, "seed {seed}");
    let keys = opened(&db.url, Some(&m1), &db.pool)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: a tier starts after migrate: {e}"));

    // The sealed values are those stored.
    for (id, _, secrets, api_key) in &legacy {
        let mut got = opened_secrets(&db.pool, &keys, *id).await;
        got.sort_by(|x, y| x.as_bytes().cmp(y.as_bytes()));
        let mut want = secrets.to_vec();
        want.sort_by(|x, y| x.as_bytes().cmp(y.as_bytes()));
        assert!(got == want, "seed {seed}: {id}'s secrets after migrate");
        assert_eq!(
            &opened_api_key(&db.pool, &keys, *id).await,
            api_key,
            "seed {seed}: {id}'s upstream key after migrate"
        );
    }
    assert_eq!(
        opened_secrets(&db.pool, &keys, sealed_id).await,
        vec![sealed_secret],
        "seed {seed}"
    );
    for (t, url) in &urls {
        match destinations::for_publishing(&db.pool, &keys, TenantId(*t)).await {
            Ok(Destination::OwnExchange {
                amqp_url,
                exchange,
                routing_key,
            }) => {
                assert_eq!(amqp_url.expose(), url, "seed {seed}");
                assert_eq!(
                    (exchange.as_str(), routing_key.as_str()),
                    ("legacy-exchange", "legacy-key")
                );
            }
            other => panic!("seed {seed}: {t}'s destination after migrate: {other:?}"),
        }
    }
    assert_eq!(
        destinations::for_publishing(&db.pool, &keys, TenantId(tenants[3]))
            .await
            .unwrap(),
        Destination::RelayQueue
    );
    // A secret given again is known by the fingerprint migrate wrote.
    let (id, tenant, secrets, _) = &legacy[0];
    let again = endpoints::add_secret(
        &db.pool,
        &keys,
        TenantId(*tenant),
        EndpointId(*id),
        &secrets[1],
        None,
    )
    .await;
    assert!(
        matches!(again, Err(StoreError::AlreadyExists { .. })),
        "seed {seed}: a legacy secret added again: {again:?}"
    );
    // The front tier verifies messages signed with a legacy secret.
    let ingest = front_tier(&db.url, keys.clone()).await;
    let (client, base_url) = (reqwest::Client::new(), format!("http://{}", ingest.address));
    for (k, s) in secrets.iter().enumerate() {
        let (_, status) = post_signed(&client, &base_url, *id, s, k as u64 + 1).await;
        assert_eq!(status, 202, "seed {seed}: legacy secret {k} verifies");
    }
    ingest.stop().await.unwrap();

    // Once more: nothing left to seal, so no key needed, and nothing changes.
    let before = census_map(&db.pool).await;
    relay::commands::migrate(&global(&db.url, None))
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: migrate again without keys: {e:#}"));
    assert_eq!(census_map(&db.pool).await, before, "seed {seed}");
}

/// `relay migrate` vacuums the three tables once it has sealed their plain text, because
/// "dead row versions still hold the plain text until vacuumed; a physical backup or a
/// replica's files would carry them" (services/relay/src/keys.rs, `seal_plaintext`). The
/// tables' pages after it, as a file-level copy of the database holds them (read with
/// pageinspect's `get_raw_page`), must then hold none of that plain text.
#[tokio::test]
async fn migrate_leaves_no_plain_text_in_the_tables_pages() {
    let seed = printed_seed("migrate_leaves_no_plain_text_in_the_tables_pages");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let db = TestDb::new().await;
    let m1 = kek("m1", &mut rng);
    let tenant = uuid(&mut rng);
    sqlx::query("INSERT INTO tenants (id, name) VALUES ($1, 'legacy')")
        .bind(tenant)
        .execute(&db.pool)
        .await
        .unwrap();
    let mut needles = Needles::default();
    // As many as an older relay's tables hold over several pages.
    for n in 0..300 {
        let (id, secret) = (uuid(&mut rng), secret(&mut rng));
        let key = format!("qk_plain_{}", hex(&rng.gen::<[u8; 12]>()));
        sqlx::query(
            "INSERT INTO webhook_endpoints (id, tenant_id, lang, upstream_api_key)
             VALUES ($1, $2, 'en', $3)",
        )
        .bind(id)
        .bind(tenant)
        .bind(&key)
        .execute(&db.pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO endpoint_secrets (tenant_id, endpoint_id, secret) VALUES ($1, $2, $3)",
        )
        .bind(tenant)
        .bind(id)
        .bind(secret.to_whsec())
        .execute(&db.pool)
        .await
        .unwrap();
        needles.push(
            format!("endpoint {n}'s secret"),
            secret.to_whsec().into_bytes(),
        );
        needles.push(format!("endpoint {n}'s API key"), key.into_bytes());
    }
    let url = format!(
        "amqp://legacy:pw{}@broker.example:5672/%2f",
        hex(&rng.gen::<[u8; 12]>())
    );
    sqlx::query(
        "INSERT INTO tenant_destinations (tenant_id, kind, amqp_url, exchange, routing_key)
         VALUES ($1, 'own_exchange', $2, 'x', 'k')",
    )
    .bind(tenant)
    .bind(&url)
    .execute(&db.pool)
    .await
    .unwrap();
    needles.push("the broker URL".into(), url.into_bytes());

    relay::commands::migrate(&global(&db.url, Some(&m1)))
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: migrate: {e:#}"));
    assert_eq!(plaintext_left(&db.pool).await, 0, "seed {seed}");

    sqlx::query("CREATE EXTENSION IF NOT EXISTS pageinspect")
        .execute(&db.pool)
        .await
        .expect("this test reads the tables' pages with pageinspect (PostgreSQL's contrib)");
    let mut pages: Vec<(String, i64, Vec<u8>)> = Vec::new();
    for table in [
        "endpoint_secrets",
        "webhook_endpoints",
        "tenant_destinations",
    ] {
        let blocks: i64 = sqlx::query_scalar(
            "SELECT pg_relation_size($1::regclass) / current_setting('block_size')::bigint",
        )
        .bind(table)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        for block in 0..blocks {
            let page: Vec<u8> = sqlx::query_scalar("SELECT get_raw_page($1, $2)")
                .bind(table)
                .bind(block)
                .fetch_one(&db.pool)
                .await
                .unwrap();
            pages.push((table.to_owned(), block, page));
        }
    }
    // The pages are the tables': they hold the sealed values.
    let sealed: Vec<u8> = sqlx::query_scalar("SELECT secret_sealed FROM endpoint_secrets LIMIT 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(
        pages
            .iter()
            .any(|(_, _, page)| page.windows(sealed.len()).any(|w| w == &sealed[..])),
        "seed {seed}: the pages read hold the sealed values"
    );
    let found: Vec<String> = pages
        .iter()
        .flat_map(|(table, block, page)| {
            needles
                .found_in(page)
                .into_iter()
                .map(move |f| format!("{table} page {block}: {f}"))
        })
        .collect();
    let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
    for f in &found {
        let (table, rest) = f.split_once(" page ").unwrap();
        let kind = if rest.contains("secret at") {
            "secrets"
        } else if rest.contains("API key at") {
            "API keys"
        } else {
            "broker URLs"
        };
        *by_kind.entry(format!("{kind} in {table}")).or_default() += 1;
    }
    assert!(
        found.is_empty(),
        "seed {seed}: after `relay migrate` the pages of the sealed tables still hold {} plain-text \
         value(s) ({by_kind:?}) that a file-level backup (pg_basebackup) or a replica's files \
         carry: its plain VACUUM (services/relay/src/keys.rs, seal_plaintext) frees the dead \
         row versions but does not clear their bytes. First ones:\n{}",
        found.len(),
        found[..found.len().min(5)].join("\n")
    );
}

// ---- 6. the logs of a whole run ------------------------------------------------------------------

/// Every log line of a whole run, at TRACE and of every crate (captured on this one thread,
/// where the test's runtime runs every tier): endpoints registered through the API with secrets
/// and upstream keys, a secret added and one rotated in, the key changed, a destination with a
/// password set, broker credentials made and rotated, messages signed and forged, everything
/// read back, a rewind sending the key upstream, the sequencer's read, `relay migrate` sealing
/// plain text, `relay keys rotate`, and values that do not open. No secret, key, password or
/// token appears in any of them, in any encoding.
#[tokio::test(flavor = "current_thread")]
async fn no_secret_reaches_the_logs() {
    let (logs, guard) = capture_logs(tracing::Level::TRACE);
    let seed = printed_seed("no_secret_reaches_the_logs");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut needles = Needles::default();
    needles.key_entry("the sealing key", SEAL_KEYS);

    let app = ApiApp::spawn_with_vhost().await;
    let upstream = SimUpstream::start(format!("qk_sim_{}", hex(&rng.gen::<[u8; 16]>()))).await;
    needles.text("the simulator's API key", &upstream.key);
    let (tenant, token) = app.tenant("logged").await;
    needles.text("the tenant's token", &token);
    needles.text("the operator's token", &Api::operator_token());

    let mut endpoint_secrets: Vec<(Uuid, Vec<SigningSecret>)> = Vec::new();
    for n in 0..2 {
        let id = uuid(&mut rng);
        let secrets = vec![secret(&mut rng), secret(&mut rng)];
        let api_key = if n == 0 {
            upstream.add_endpoint(id, &secrets[0]);
            upstream.key.clone()
        } else {
            format!("qk_other_{}", hex(&rng.gen::<[u8; 16]>()))
        };
        needles.text(&format!("endpoint {n}'s API key"), &api_key);
        for (k, s) in secrets.iter().enumerate() {
            needles.secret(&format!("endpoint {n}'s secret {k}"), s);
        }
        app.ok(
            201,
            "POST",
            "/v1/endpoints",
            &token,
            Some(&json!({
                "id": id, "lang": "en",
                "secrets": secrets.iter().map(SigningSecret::to_whsec).collect::<Vec<_>>(),
                "upstream_base_url": upstream.base_url, "upstream_api_key": api_key,
            })),
        )
        .await;
        endpoint_secrets.push((id, secrets));
    }
    let (first, second) = (endpoint_secrets[0].0, endpoint_secrets[1].0);
    let path = |id: Uuid, suffix: &str| format!("/v1/endpoints/{id}{suffix}");
    let added = secret(&mut rng);
    let rotated_in = secret(&mut rng);
    let changed_key = format!("qk_changed_{}", hex(&rng.gen::<[u8; 16]>()));
    needles.secret("the secret added", &added);
    needles.secret("the secret rotated in", &rotated_in);
    needles.text("the changed API key", &changed_key);
    let password = format!("pw-{}", hex(&rng.gen::<[u8; 12]>()));
    let amqp_url = format!("amqp://tenant:{password}@broker.example:5672/%2f");
    needles.text("the destination's password", &password);
    needles.text("the destination's URL", &amqp_url);
    let writes: Vec<(&str, String, Value, u16)> = vec![
        (
            "POST",
            path(second, "/secrets"),
            json!({"secret": added.to_whsec()}),
            201,
        ),
        (
            "POST",
            path(second, "/secrets/rotate"),
            json!({"secret": rotated_in.to_whsec(), "overlap_s": 600}),
            200,
        ),
        (
            "PATCH",
            path(second, ""),
            json!({"upstream_api_key": changed_key}),
            200,
        ),
        (
            "PUT",
            "/v1/destination".into(),
            json!({"kind": "own_exchange", "amqp_url": amqp_url, "exchange": "x",
                   "routing_key": "k"}),
            200,
        ),
    ];
    for (method, path, body, status) in &writes {
        app.ok(*status, method, path, &token, Some(body)).await;
    }
    // Refused writes carrying secrets: the secret repeated, one the endpoint holds, a
    // malformed one.
    let refused_writes: Vec<(&str, String, Value)> = vec![
        (
            "POST",
            "/v1/endpoints".into(),
            json!({"id": uuid(&mut rng), "lang": "en",
                   "secrets": [added.to_whsec(), added.to_whsec()]}),
        ),
        (
            "POST",
            path(second, "/secrets"),
            json!({"secret": rotated_in.to_whsec()}),
        ),
        (
            "POST",
            path(second, "/secrets"),
            json!({"secret": format!("{}!", added.to_whsec())}),
        ),
    ];
    for (method, path, body) in &refused_writes {
        let answer = app.call(method, path, Some(&token), Some(body)).await;
        assert!(
            (400..500).contains(&answer.status),
            "seed {seed}: {method} {path}: {}",
            answer.text
        );
    }
    endpoint_secrets[1].1.extend([added, rotated_in]);

    let _user = BrokerUser(relay_api::BrokerAccess::username(TenantId(tenant)));
    for (method, path, status) in [
        ("POST", "/v1/broker/credentials", 201),
        ("POST", "/v1/broker/credentials/rotate", 200),
    ] {
        let answer = app.ok(status, method, path, &token, None).await;
        let password = answer["password"].as_str().expect("shown once");
        needles.text(&format!("the broker password of {path}"), password);
    }

    // Messages: every secret's, and forged ones.
    let ingest = start_front_tier(&app.db.url, test_config(), Arc::new(SystemClock)).await;
    let (client, base_url) = (reqwest::Client::new(), format!("http://{}", ingest.address));
    for (id, secrets) in &endpoint_secrets {
        for (k, s) in secrets.iter().enumerate() {
            let (_, status) = post_signed(&client, &base_url, *id, s, k as u64 + 1).await;
            assert_eq!(status, 202, "seed {seed}: {id}'s secret {k}");
        }
        let forged = secret(&mut rng);
        needles.secret("a forged secret", &forged);
        let (_, status) = post_signed(&client, &base_url, *id, &forged, 50).await;
        assert_eq!(status, 401, "seed {seed}: forged");
    }

    // Reads of everything.
    for read in [
        "/v1/endpoints".to_owned(),
        path(first, ""),
        path(second, ""),
        path(second, "/secrets"),
        path(first, "/state"),
        path(first, "/messages?include_body=true"),
        "/v1/destination".to_owned(),
        "/v1/broker/credentials".to_owned(),
    ] {
        app.ok(200, "GET", &read, &token, None).await;
    }
    // The publisher opens each tenant's broker URL to send it the tenant's changes: this
    // tenant's (set through the API) names a host that does not resolve; another tenant's
    // names RabbitMQ (behind a proxy of the test's own, as a tenant's broker elsewhere) with a
    // password it refuses.
    let room = crate::stack::Room::new().await;
    let proxy = relay_tests::PgProxy::start(relay_tests::amqp_addr()).await;
    let other_tenant = app.db.tenant().await;
    let refused_password = format!("pw-refused-{}", hex(&rng.gen::<[u8; 12]>()));
    let refused_url = format!(
        "amqp://relay-test-nobody:{refused_password}@{}/{}",
        proxy.address, room.vhost.name
    );
    needles.text("the refused broker password", &refused_password);
    needles.text("the refused broker URL", &refused_url);
    destinations::set(
        &app.db.pool,
        &relay_tests::keys(),
        TenantId(other_tenant),
        &Destination::OwnExchange {
            amqp_url: refused_url.as_str().into(),
            exchange: "x".into(),
            routing_key: "k".into(),
        },
    )
    .await
    .unwrap();
    let mut feeds = crate::publisher::feeds_of(&app.db, [tenant, other_tenant]).await;
    let mut feed_rng = rand::rngs::StdRng::seed_from_u64(seed);
    crate::publisher::write(&app.db.pool, &mut feeds, &mut feed_rng, 10).await;
    let mut config = crate::stack::publisher_config(room.vhost.url(), &room.prefix.0);
    config.destination_policy = relay_rules::DestinationPolicy {
        allow_private: true,
        ..relay_rules::DestinationPolicy::default()
    };
    let (publisher, _registry) = crate::stack::start_publisher(&app.db.pool, config).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let troubled = |tenant: Uuid| {
        logs.text()
            .lines()
            .any(|line| line.contains("broker trouble") && line.contains(&tenant.to_string()))
    };
    while !(troubled(tenant) && troubled(other_tenant)) {
        assert!(
            Instant::now() < deadline,
            "seed {seed}: the publisher tried both tenants' brokers"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    publisher.stop().await;
    drop(proxy);

    // A rewind sends the first endpoint's key upstream; the second's key is not the upstream's.
    for id in [first, second] {
        relay_tests::execute_for(
            &app.db,
            "INSERT INTO endpoint_tracks (endpoint_id, track, tenant_id, generation, through)
             VALUES ($1, 'feed', $2, 1, '1.1000')",
            id,
            tenant,
        )
        .await;
    }
    let rewound = app
        .ok(
            200,
            "POST",
            &path(first, "/tracks/feed/rewind"),
            &token,
            None,
        )
        .await;
    assert_eq!(rewound["upstream"]["status"], 202, "seed {seed}: {rewound}");
    let refused = app
        .call(
            "POST",
            &path(second, "/tracks/feed/rewind"),
            Some(&token),
            None,
        )
        .await;
    assert!(refused.status >= 400, "seed {seed}: {}", refused.text);
    // The sequencer's read with the key it opens.
    let keys = relay_tests::keys();
    assert_eq!(
        upstream_read(&app.db.pool, &keys, first).await,
        Ok("en".to_owned()),
        "seed {seed}"
    );
    assert!(upstream_read(&app.db.pool, &keys, second).await.is_err());

    // `relay migrate` sealing what an older relay stored (its values bound, so that no
    // statement's text holds them).
    let legacy_tenant = uuid(&mut rng);
    let legacy_endpoint = uuid(&mut rng);
    let legacy_secret = secret(&mut rng);
    let legacy_key = format!("qk_legacy_{}", hex(&rng.gen::<[u8; 16]>()));
    let legacy_url = format!(
        "amqp://legacy:pw{}@broker.example:5672/%2f",
        hex(&rng.gen::<[u8; 12]>())
    );
    needles.secret("the legacy secret", &legacy_secret);
    needles.text("the legacy API key", &legacy_key);
    needles.text("the legacy broker URL", &legacy_url);
    sqlx::query("INSERT INTO tenants (id, name) VALUES ($1, 'legacy')")
        .bind(legacy_tenant)
        .execute(&app.db.pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO webhook_endpoints (id, tenant_id, lang, upstream_api_key)
         VALUES ($1, $2, 'en', $3)",
    )
    .bind(legacy_endpoint)
    .bind(legacy_tenant)
    .bind(&legacy_key)
    .execute(&app.db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO endpoint_secrets (tenant_id, endpoint_id, secret) VALUES ($1, $2, $3)",
    )
    .bind(legacy_tenant)
    .bind(legacy_endpoint)
    .bind(legacy_secret.to_whsec())
    .execute(&app.db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO tenant_destinations (tenant_id, kind, amqp_url, exchange, routing_key)
         VALUES ($1, 'own_exchange', $2, 'x', 'k')",
    )
    .bind(legacy_tenant)
    .bind(&legacy_url)
    .execute(&app.db.pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO endpoint_arrival_counters (endpoint_id) VALUES ($1)")
        .bind(legacy_endpoint)
        .execute(&app.db.pool)
        .await
        .unwrap();
    let refusal = opened(&app.db.url, Some(SEAL_KEYS), &app.db.pool)
        .await
        .expect_err("plain text refused");
    tracing::warn!(%refusal, "the start-up refusal, logged as the binary logs it");
    relay::commands::migrate(&global(&app.db.url, Some(SEAL_KEYS)))
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: migrate: {e:#}"));
    assert_eq!(
        opened_secrets(&app.db.pool, &keys, legacy_endpoint).await,
        vec![legacy_secret],
        "seed {seed}"
    );

    // A value moved to another row, loaded by the front tier and the sequencer: logged as
    // unreadable, and by its error only.
    sqlx::query(
        "UPDATE webhook_endpoints t
         SET upstream_api_key_sealed = s.upstream_api_key_sealed,
             upstream_api_key_key_id = s.upstream_api_key_key_id
         FROM (SELECT upstream_api_key_sealed, upstream_api_key_key_id
               FROM webhook_endpoints WHERE id = $1) s
         WHERE t.id = $2",
    )
    .bind(first)
    .bind(legacy_endpoint)
    .execute(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(
        opened_api_key(&app.db.pool, &keys, legacy_endpoint).await,
        None
    );

    // `relay keys rotate` to a new key; the old key alone then opens nothing it did.
    let next = kek("next", &mut rng);
    needles.key_entry("the next key", &next);
    let rotating = keyring(&format!("{next}\n{SEAL_KEYS}"));
    let error = relay::keys::rotate(&app.db.pool, &rotating, Duration::ZERO)
        .await
        .expect_err("the moved key stops the rotation");
    tracing::error!(error = %format!("{error:#}"), "the rotation's failure, logged");
    sqlx::query(
        "UPDATE webhook_endpoints SET upstream_api_key_sealed = NULL,
                                      upstream_api_key_key_id = NULL WHERE id = $1",
    )
    .bind(legacy_endpoint)
    .execute(&app.db.pool)
    .await
    .unwrap();
    relay::keys::rotate(&app.db.pool, &rotating, Duration::ZERO)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: rotate: {e:#}"));
    assert!(
        opened_secrets(&app.db.pool, &keys, first).await.is_empty(),
        "seed {seed}: the old key alone opens a secret re-sealed under the next"
    );
    assert_eq!(opened_api_key(&app.db.pool, &keys, second).await, None);
    // The front tier (given the old key only) hears of the re-sealed rows and refuses.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut n = 100;
    let status = loop {
        n += 1;
        let (_, status) =
            post_signed(&client, &base_url, first, &endpoint_secrets[0].1[0], n).await;
        if status == 401 || Instant::now() > deadline {
            break status;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        status, 401,
        "seed {seed}: a front tier without the new key opens no secret re-sealed under it"
    );

    let deleted = app
        .call("DELETE", "/v1/broker/credentials", Some(&token), None)
        .await;
    assert_eq!(deleted.status, 204, "seed {seed}: {}", deleted.text);
    ingest.stop().await.unwrap();
    app.stop().await;
    drop(guard);

    let text = logs.text();
    for expected in [
        "endpoint registered",
        "secret rotated",
        "destination set",
        "broker credentials rotated",
        "broker trouble",
        "rewind after restore",
        "secrets stored in plain text are sealed",
        "re-sealed under the current key",
        "unreadable stored secret",
        "unreadable stored upstream API key",
    ] {
        assert!(
            text.contains(expected),
            "seed {seed}: the logs were captured: no `{expected}` in {} bytes",
            text.len()
        );
    }
    let found = needles.found_in(text.as_bytes());
    assert!(
        found.is_empty(),
        "seed {seed}: log lines hold secrets:\n{}",
        found.join("\n")
    );
}
