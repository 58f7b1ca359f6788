//! Offboarding: `DELETE /v1/endpoints/{id}` and `DELETE /v1/tenants/{id}` while messages
//! arrive, reloads run and the publisher streams. What was deleted must leave nothing behind:
//! no row in any table keyed by endpoint (found from the schema, so a table added later is
//! checked too), no Redis key naming it, no queue or broker user of a deleted tenant; the
//! other endpoints must converge to the oracle as if nothing happened; and a deleted id can be
//! registered again. A delete whose process stopped after the mark, or half way through the
//! purge, is finished by the next control plane to start.

use std::time::{Duration, Instant};

use relay_netguard::OutboundPolicy;
use relay_simulator::cli::prepare;
use relay_simulator::Faults;
use relay_tests::{feed_body, printed_seed, redis_url, RedisPrefix, Signed, TestApp, Vhost};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::publisher::declare_passive;
use crate::stack::{
    backlog, connect_broker, copy_items, describe_difference, oracle, serve_simulation,
    simulate_args, stop_simulation, upstream_listener, Api, Backlog, Relay, Room, Steady,
};

/// Every row anywhere that belongs to one of `endpoints` or `tenant`: `(table, rows)` for each
/// table holding some. The tables are read from the schema: every table with an `endpoint_id`
/// or `tenant_id` column, and the endpoints' and tenants' own tables.
async fn leftovers(pool: &PgPool, endpoints: &[Uuid], tenant: Option<Uuid>) -> Vec<(String, i64)> {
    let columns: Vec<(String, String)> = sqlx::query_as(
        "SELECT table_name::text, column_name::text FROM information_schema.columns
         WHERE table_schema = 'public' AND column_name IN ('endpoint_id', 'tenant_id')
           AND table_name <> '_sqlx_migrations'
         UNION ALL SELECT 'webhook_endpoints', 'id'
         UNION ALL SELECT 'tenants', 'id'
         ORDER BY 1, 2",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut found = Vec::new();
    for (table, column) in columns {
        let ids: Vec<Uuid> = match (table.as_str(), column.as_str()) {
            ("tenants", "id") | (_, "tenant_id") => tenant.into_iter().collect(),
            _ => endpoints.to_vec(),
        };
        if ids.is_empty() {
            continue;
        }
        let rows: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {table} WHERE {column} = ANY($1)"
        ))
        .bind(&ids)
        .fetch_one(pool)
        .await
        .unwrap();
        if rows > 0 {
            found.push((format!("{table}.{column}"), rows));
        }
    }
    found
}

/// Redis keys under `prefix` that name one of `ids`.
fn redis_keys_naming(prefix: &str, ids: &[Uuid]) -> Vec<String> {
    let client = redis::Client::open(redis_url()).unwrap();
    let mut connection = client.get_connection().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query(&mut connection)
        .unwrap();
    keys.into_iter()
        .filter(|key| ids.iter().any(|id| key.contains(&id.to_string())))
        .collect()
}

fn broker_users() -> String {
    let users = std::process::Command::new("rabbitmqctl")
        .args(["list_users", "--quiet"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&users.stdout).into_owned()
}

/// Polls `check` until it answers `None`, or panics with its last answer after `limit`.
async fn wait_for<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<String>>,
{
    let started = Instant::now();
    loop {
        let Some(left) = check().await else {
            eprintln!("{what}: gone after {:?}", started.elapsed());
            return;
        };
        assert!(started.elapsed() < limit, "{what}: {left}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_under_load_leave_nothing_and_touch_no_other_endpoint() {
    let seed = printed_seed("offboarding");
    let room = Room::new().await;
    let relay = Relay::start(&room).await;
    let (app, api, pool) = (&relay.app, &relay.api, relay.pool());

    // Two tenants, three endpoints each, every fault on (so reloads run as the deletes land).
    let (sim_listener, upstream_api) = upstream_listener("127.0.0.1").await;
    let args = simulate_args(&app.base_url, 6, 2, seed, 30.0, 8);
    let (mut upstream, workload, infos) = prepare(&args).unwrap();
    upstream.set_faults(Faults::all());
    let (a, a_token) = api.tenant("offboarding A").await;
    let (b, b_token) = api.tenant("offboarding B").await;
    let a_key = infos[0].key_token.clone();
    let mut a_endpoints = Vec::new();
    let mut b_endpoints = Vec::new();
    for info in &infos {
        if info.key_token == a_key {
            api.register(&a_token, info, &upstream_api).await;
            a_endpoints.push(info.id);
        } else {
            api.register(&b_token, info, &upstream_api).await;
            b_endpoints.push(info.id);
        }
    }
    // B's own broker user and queues, which deleting B must remove from the broker.
    api.ok(201, "POST", "/v1/broker/credentials", &b_token, None)
        .await;
    let b_user = format!("relay-tenant-{b}");
    assert!(broker_users().contains(&b_user));

    let (sim, senders) = serve_simulation(upstream, Duration::from_secs(2), sim_listener).await;
    let workload = tokio::spawn(
        sim.clone()
            .run_workload(workload, 30.0, Duration::from_secs(8)),
    );

    // Mid-stream: one of A's endpoints, then all of B.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let deleted = a_endpoints[0];
    let path = format!("/v1/endpoints/{deleted}");
    let answer = api.ok(202, "DELETE", &path, &a_token, None).await;
    assert_eq!(answer, json!({"id": deleted, "status": "deleting"}));
    // From the answer on: gone from every read; the front tier answers 404.
    let again = api.call("DELETE", &path, Some(&a_token), None).await;
    assert!(matches!(again.status, 202 | 404), "{}", again.text);
    let read = api.call("GET", &path, Some(&a_token), None).await;
    assert_eq!(read.status, 404);
    let listed = api.ok(200, "GET", "/v1/endpoints", &a_token, None).await;
    assert!(
        !listed.to_string().contains(&deleted.to_string()),
        "{listed}"
    );
    let secret = relay_wire::SigningSecret::parse(&infos[0].secrets[0]).unwrap();
    let late = app
        .post(deleted, &Signed::new(&[secret], feed_body(deleted, 1)))
        .await;
    assert_eq!(late.status(), 404);

    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let operator = Api::operator_token();
    let answer = api
        .ok(202, "DELETE", &format!("/v1/tenants/{b}"), &operator, None)
        .await;
    assert_eq!(answer["status"], "deleting");
    assert_eq!(
        api.call("GET", &format!("/v1/tenants/{b}"), Some(&operator), None)
            .await
            .status,
        404
    );
    workload.await.unwrap();

    // Nothing of them left in Postgres, Redis or on the broker.
    wait_for(
        "the deleted endpoint's rows",
        Duration::from_secs(60),
        || async {
            let left = leftovers(pool, &[deleted], None).await;
            (!left.is_empty()).then(|| format!("{left:?}"))
        },
    )
    .await;
    wait_for(
        "the deleted tenant's rows",
        Duration::from_secs(60),
        || async {
            let left = leftovers(pool, &b_endpoints, Some(b)).await;
            (!left.is_empty()).then(|| format!("{left:?}"))
        },
    )
    .await;
    let mut gone: Vec<Uuid> = b_endpoints.clone();
    gone.extend([deleted, b]);
    // Leases left behind expire by themselves; a worker that let go deletes its own.
    wait_for(
        "Redis keys naming them",
        Duration::from_secs(30),
        || async {
            let keys = redis_keys_naming(&room.prefix.0, &gone);
            (!keys.is_empty()).then(|| format!("{keys:?}"))
        },
    )
    .await;
    assert!(!broker_users().contains(&b_user), "B's broker user is left");
    let broker = connect_broker(&room.vhost.url(), "offboarding").await;
    for queue in [
        relay_publisher::tenant_queue(b),
        format!("{}.dead-letter", relay_publisher::tenant_queue(b)),
    ] {
        let channel = broker.create_channel().await.unwrap();
        let declared = declare_passive(&channel, &queue).await;
        assert!(declared.is_err(), "queue {queue} is left");
    }

    // A's other endpoints: as if nothing happened.
    sim.change(|upstream, _| upstream.set_faults(Faults::default()));
    let others: Vec<Uuid> = a_endpoints[1..].to_vec();
    // (The upstream keeps retrying what it sends the deleted endpoints, as it would until the
    // team deletes them there too: only the others' deliveries are waited for.)
    let settling = Instant::now();
    let mut steady = Steady::default();
    loop {
        let idle = others.iter().all(|&id| sim.lock().is_idle(id));
        let left = backlog(pool, &others).await;
        let mut differences = Vec::new();
        for &id in &others {
            let (copy, truth) = (copy_items(pool, id).await, oracle(&sim, id));
            if copy != truth {
                differences.push(format!("{id}: {}", describe_difference(&copy, &truth)));
            }
        }
        if steady.look(idle && left == Backlog::NONE && differences.is_empty()) {
            break;
        }
        assert!(
            settling.elapsed() < Duration::from_secs(180),
            "seed {seed}: A's other endpoints did not settle (idle {idle}, {left:?}): {}",
            differences.join(" | ")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "offboarding: seed {seed}: the other endpoints settled in {:?}",
        settling.elapsed()
    );
    assert!(
        leftovers(pool, &others, Some(a)).await.len() > 2,
        "A's other endpoints still have their rows"
    );

    // The id is free again: registered anew, it starts from nothing.
    api.register(&a_token, &infos[0], &upstream_api).await;
    let state = api
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{deleted}/state"),
            &a_token,
            None,
        )
        .await;
    assert_eq!(state["change_epoch"], 1, "{state}");

    stop_simulation(&sim, senders).await;
    let _ = broker.close(200, "done").await;
    relay.stop().await;
}

/// A delete is two steps, each committed: the mark, then the purge's batches and its last
/// transaction. A process that dies after any of them leaves a state the next control plane
/// finishes from: here the mark alone (a tenant), and the mark with part of the purge done (an
/// endpoint), found by a control plane started afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_interrupted_half_way_is_finished_by_the_next_control_plane() {
    let vhost = tokio::task::spawn_blocking(Vhost::create).await.unwrap();
    let app = TestApp::spawn().await;
    let pool = app.db.pool.clone();
    let api = Api::start(&app.db.url, &vhost.url(), OutboundPolicy::ANY).await;
    let (a, _) = api.tenant("interrupted A").await;
    let (b, b_token) = api.tenant("interrupted B").await;
    api.ok(201, "POST", "/v1/broker/credentials", &b_token, None)
        .await;
    let b_user = format!("relay-tenant-{b}");
    let (a_endpoint, a_secret) = (Uuid::new_v4(), relay_tests::random_secret());
    app.db.endpoint(a, a_endpoint, &a_secret).await;
    for n in 0..40 {
        let message = Signed::new(std::slice::from_ref(&a_secret), feed_body(a_endpoint, n));
        assert_eq!(app.post(a_endpoint, &message).await.status(), 202);
    }
    let (b_endpoint, b_secret) = (Uuid::new_v4(), relay_tests::random_secret());
    app.db.endpoint(b, b_endpoint, &b_secret).await;
    // The control plane is gone before the deletes are asked for: they are carried as far as
    // a process that then died would have.
    api.server.stop().await.unwrap();

    use relay_store::offboard;
    let marked = offboard::mark_endpoint(
        &pool,
        relay_store::TenantId(a),
        relay_store::EndpointId(a_endpoint),
    )
    .await
    .unwrap();
    assert_eq!(marked, Some(offboard::Marked::Marked));
    let purged = offboard::purge_rows(&pool, relay_store::EndpointId(a_endpoint), 10)
        .await
        .unwrap();
    assert!(purged > 0);
    assert!(!leftovers(&pool, &[a_endpoint], None).await.is_empty());
    offboard::mark_tenant(&pool, relay_store::TenantId(b))
        .await
        .unwrap();
    // Meanwhile the front tier answers 404 for both.
    for (endpoint, secret) in [(a_endpoint, &a_secret), (b_endpoint, &b_secret)] {
        let message = Signed::new(std::slice::from_ref(secret), feed_body(endpoint, 99));
        assert_eq!(app.post(endpoint, &message).await.status(), 404);
    }

    // The next control plane to start finishes both.
    let api = Api::start(&app.db.url, &vhost.url(), OutboundPolicy::ANY).await;
    wait_for(
        "the interrupted deletes",
        Duration::from_secs(60),
        || async {
            let mut left = leftovers(&pool, &[a_endpoint], None).await;
            left.extend(leftovers(&pool, &[b_endpoint], Some(b)).await);
            (!left.is_empty()).then(|| format!("{left:?}"))
        },
    )
    .await;
    wait_for("B's broker user", Duration::from_secs(30), || async {
        broker_users()
            .contains(&b_user)
            .then(|| "still there".to_owned())
    })
    .await;
    // A itself stays: only its endpoint was deleted.
    assert_eq!(
        leftovers(&pool, &[], Some(a)).await,
        vec![("tenants.id".to_owned(), 1)]
    );
    api.server.stop().await.unwrap();
    app.stop().await;
}

/// The control plane, a process of its own, SIGKILLed just after it answered a delete (its
/// purge of 60,000 stored messages in batches has begun or is about to): the endpoint stays
/// unreachable, and the next control plane to start finishes the delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_killed_mid_delete_is_finished_by_the_next_one() {
    use crate::scale_out::{free_address, global_options, TierProcess};
    const KEY: &str = "offboarding-test-signing-key-of-32-bytes-or-more";
    let vhost = tokio::task::spawn_blocking(Vhost::create).await.unwrap();
    let prefix = RedisPrefix(format!("relay-test-{}:", Uuid::new_v4().simple()));
    let app = TestApp::spawn().await;
    let pool = app.db.pool.clone();
    let tenant = app.db.tenant().await;
    let (endpoint, secret) = (Uuid::new_v4(), relay_tests::random_secret());
    app.db.endpoint(tenant, endpoint, &secret).await;
    // Many stored messages, so the purge takes several batches.
    sqlx::query(
        "WITH stored AS (
             INSERT INTO messages (endpoint_id, arrival_seq, tenant_id, webhook_id, signed_at,
                                   received_at, body)
             SELECT $1, n, $2, 'msg_' || n, now(), now(), convert_to(repeat('x', 200), 'UTF8')
             FROM generate_series(1, 60000) AS n
             RETURNING 1
         )
         UPDATE endpoint_arrival_counters SET last_arrival_seq = (SELECT count(*) FROM stored)
         WHERE endpoint_id = $1",
    )
    .bind(endpoint)
    .bind(tenant)
    .execute(&pool)
    .await
    .unwrap();

    let global = global_options(&app.db.url, &prefix.0, &[]);
    let amqp_url = vhost.url();
    let client = reqwest::Client::new();
    let start_api = |address| TierProcess::start_api("api", &global, address, &amqp_url, KEY);
    let address = free_address();
    let api = start_api(address);
    api.wait_ready(&client).await;
    let token = crate::stack::token_for(KEY.as_bytes(), &relay_api::Subject::Tenant(tenant));
    let answer = crate::stack::call_api(
        &client,
        &format!("http://{address}"),
        "DELETE",
        &format!("/v1/endpoints/{endpoint}"),
        Some(&token),
        None,
    )
    .await;
    assert_eq!(answer.status, 202, "{}", answer.text);
    api.kill().await;
    let left_at_kill = leftovers(&pool, &[endpoint], None).await;
    eprintln!("offboarding: left when the control plane was killed: {left_at_kill:?}");
    // Unreachable meanwhile.
    let message = Signed::new(std::slice::from_ref(&secret), feed_body(endpoint, 1));
    assert_eq!(app.post(endpoint, &message).await.status(), 404);

    let address = free_address();
    let api = start_api(address);
    api.wait_ready(&client).await;
    wait_for(
        "the killed control plane's delete",
        Duration::from_secs(60),
        || async {
            let left = leftovers(&pool, &[endpoint], None).await;
            (!left.is_empty()).then(|| format!("{left:?}"))
        },
    )
    .await;
    api.kill().await;
    app.stop().await;
}
