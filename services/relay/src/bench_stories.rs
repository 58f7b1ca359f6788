//! `relay bench stories`: stories endpoints' events applied per second and a reload in full of
//! a large stories copy, each beside the feed's figure for the same amount of work, measured in
//! the same run (BENCHMARKS.md). The phases alternate, feed then stories, for `--rounds`, each
//! on a database made for it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use clap::Args;
use relay_rules::StoriesMode;
use relay_store::endpoints::{self, Registration, Source, StoriesSettings};
use relay_store::{tenants, EndpointId, TenantId};
use relay_wire::SigningSecret;
use serde_json::{json, Value};
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::bench::{
    apply_stored, fresh_database, start_sequencer, stored_message, ApplyBenchArgs, Batches,
    ReloadBenchArgs,
};
use crate::cli::{GlobalArgs, SequencerArgs};

#[derive(Debug, Args)]
pub struct StoriesBenchArgs {
    /// Drop and create RELAY_DATABASE_URL's database for each phase (required).
    #[arg(long)]
    pub recreate_database: bool,
    #[arg(long, default_value_t = 1000)]
    pub endpoints: usize,
    /// Webhooks of one event each per endpoint, every one a newer snapshot of one of the
    /// endpoint's stories (round robin): every event changes the copy.
    #[arg(long, default_value_t = 30)]
    pub events_per_endpoint: usize,
    #[arg(long, default_value_t = 50)]
    pub stories_per_endpoint: usize,
    /// Stories of the reload in full (0: no reload phase), over `--tickers` tickers.
    #[arg(long, default_value_t = 100_000)]
    pub reload_stories: usize,
    #[arg(long, default_value_t = 10)]
    pub tickers: usize,
    /// Feed and stories phases, alternating, this many times.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    #[command(flatten)]
    pub sequencer: SequencerArgs,
}

pub async fn run(global: &GlobalArgs, args: StoriesBenchArgs) -> anyhow::Result<()> {
    for round in 1..=args.rounds {
        eprintln!("round {round}: the feed's events");
        crate::bench::apply(
            global,
            ApplyBenchArgs {
                recreate_database: args.recreate_database,
                endpoints: args.endpoints,
                messages_per_endpoint: args.events_per_endpoint,
                events_per_message: 1,
                items_per_endpoint: args.stories_per_endpoint,
                sequencer: args.sequencer.clone(),
            },
        )
        .await?;
        eprintln!("round {round}: the stories' events");
        apply(global, &args).await?;
        if args.reload_stories > 0 {
            eprintln!("round {round}: the feed's reload");
            crate::bench::reload(
                global,
                ReloadBenchArgs {
                    recreate_database: args.recreate_database,
                    items: args.reload_stories,
                    changed: 0.1,
                    removed: 0.05,
                    sequencer: args.sequencer.clone(),
                },
            )
            .await?;
            eprintln!("round {round}: the stories' reload");
            reload(global, &args).await?;
        }
    }
    Ok(())
}

fn secret() -> SigningSecret {
    SigningSecret::parse("whsec_YmVuY2gtc2VjcmV0LWJlbmNoLXNlY3JldA==").expect("a valid secret")
}

/// About 1 KB, as the feed bench's items.
fn story_json(id: &str, ticker: &str, version: u64) -> Value {
    json!({
        "id": id, "ticker": ticker, "version": version,
        "headline": format!("Alfa wins SEK 500M order, its largest to date ({id} v{version})"),
        "summary": "Alfa Group has won an order worth SEK 500 million from Northern Data \
            Centres, its largest to date, with deliveries from the first quarter of 2027 and \
            options for two more years.",
        "articles": (0..6).map(|a| json!({"id": format!("ar_{id}_{a}"), "story_id": id,
                                          "title": format!("Article {a} of {id}")}))
            .collect::<Vec<_>>(),
    })
}

async fn stories_tenant(
    pool: &PgPool,
    keys: &relay_store::Keyring,
    endpoints: &[Uuid],
    tickers: Vec<String>,
    upstream: Option<&str>,
) -> anyhow::Result<Uuid> {
    let tenant = Uuid::new_v4();
    tenants::create(pool, tenant, "bench").await?;
    for &id in endpoints {
        endpoints::register(
            pool,
            keys,
            TenantId(tenant),
            &Registration {
                id: EndpointId(id),
                name: None,
                source: Source::Stories(StoriesSettings {
                    mode: StoriesMode::Snapshot,
                    tickers: tickers.clone(),
                }),
                lang: None,
                upstream_base_url: upstream.map(str::to_owned),
                upstream_api_key: upstream.map(|_| format!("bench-key-{id}").into()),
                secrets: vec![secret()],
            },
        )
        .await?;
    }
    Ok(tenant)
}

/// Stores every endpoint's webhooks, then times the sequencer applying them all.
async fn apply(global: &GlobalArgs, args: &StoriesBenchArgs) -> anyhow::Result<()> {
    let pool = fresh_database(global, args.recreate_database).await?;
    let endpoints: Vec<Uuid> = (0..args.endpoints).map(|_| Uuid::new_v4()).collect();
    // No upstream settings: the endpoints never sync, so only webhooks are timed.
    let tenant = stories_tenant(
        &pool,
        &global.seal.keyring()?,
        &endpoints,
        vec!["ALFA B".into()],
        None,
    )
    .await?;
    let started = Instant::now();
    let mut batches = Batches::new(&pool);
    for k in 0..args.events_per_endpoint {
        let story = k % args.stories_per_endpoint;
        let version = (k / args.stories_per_endpoint + 1) as u64;
        let kind = if version == 1 {
            "story.created"
        } else {
            "story.updated"
        };
        for &endpoint in &endpoints {
            let id = format!("st_{story}");
            let body = json!({
                "event_id": format!("evt_{}", Uuid::new_v4().simple()), "type": kind,
                "origin": "live", "created_at": "2026-10-08T06:40:00.300000Z",
                "data": {"story": story_json(&id, "ALFA B", version)},
            });
            batches
                .push(stored_message(endpoint, tenant, None, &body)?)
                .await?;
        }
    }
    let events = (args.endpoints * args.events_per_endpoint) as i64;
    let what = format!("{events} stories webhooks");
    let (elapsed, changes) = apply_stored(global, &args.sequencer, batches, started, &what).await?;
    if changes != events {
        bail!("{events} events changed the copies {changes} times: each should have once");
    }
    println!(
        "{}",
        json!({
            "bench": "stories_apply",
            "endpoints": args.endpoints,
            "events": events,
            "seconds": (elapsed * 100.0).round() / 100.0,
            "events_per_s": (events as f64 / elapsed).round(),
            "changes_written": changes,
        })
    );
    pool.close().await;
    Ok(())
}

/// The stories API a reload reads: each ticker's open stories in pages of 500, no events, and
/// 404 `not_found` for any story read alone (every story it is asked for is gone).
struct StaticStories {
    pages: HashMap<String, Vec<Value>>,
}

async fn stories_page(
    State(stories): State<Arc<StaticStories>>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let page = query
        .get("cursor")
        .and_then(|c| c.parse::<usize>().ok())
        .unwrap_or(0);
    let Some(pages) = query.get("ticker").and_then(|t| stories.pages.get(t)) else {
        return (StatusCode::NOT_FOUND, Json(json!({"error": "not_found"}))).into_response();
    };
    Json(
        pages
            .get(page)
            .cloned()
            .unwrap_or_else(|| json!({"data": [], "next_cursor": null, "has_more": false})),
    )
    .into_response()
}

async fn no_events() -> Json<Value> {
    Json(json!({"data": [], "next_cursor": "end", "has_more": false}))
}

async fn gone(Path(_id): Path<String>) -> Response {
    (StatusCode::NOT_FOUND, Json(json!({"error": "not_found"}))).into_response()
}

async fn serve_stories(
    stories: Vec<(String, String, u64)>,
) -> anyhow::Result<(String, tokio::task::JoinHandle<()>)> {
    let mut by_ticker: HashMap<String, Vec<Value>> = HashMap::new();
    let mut listed: HashMap<String, Vec<Value>> = HashMap::new();
    for (id, ticker, version) in stories {
        listed
            .entry(ticker.clone())
            .or_default()
            .push(story_json(&id, &ticker, version));
    }
    for (ticker, stories) in listed {
        let chunks: Vec<Vec<Value>> = stories.chunks(500).map(<[Value]>::to_vec).collect();
        let count = chunks.len();
        let pages = chunks
            .into_iter()
            .enumerate()
            .map(|(i, data)| {
                let more = i + 1 < count;
                json!({"data": data, "next_cursor": more.then(|| (i + 1).to_string()),
                       "has_more": more})
            })
            .collect();
        by_ticker.insert(ticker, pages);
    }
    let app = Router::new()
        .route("/v1/stories", get(stories_page))
        .route("/v1/stories/{id}", get(gone))
        .route("/v1/events", get(no_events))
        .with_state(Arc::new(StaticStories { pages: by_ticker }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = format!("http://{}", listener.local_addr()?);
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((address, task))
}

/// Times the sequencer from its start until the endpoint's reload in full has finished and
/// caught up after `after` (its last reload before).
async fn timed_reload(
    global: &GlobalArgs,
    args: &SequencerArgs,
    pool: &PgPool,
    endpoint: Uuid,
    after: Option<OffsetDateTime>,
) -> anyhow::Result<(f64, OffsetDateTime)> {
    let started = Instant::now();
    let sequencer = start_sequencer(global, args).await?;
    let finished = loop {
        let done: Option<(Option<OffsetDateTime>, Option<OffsetDateTime>)> = sqlx::query_as(
            "SELECT reloaded_at, caught_up_at FROM stories_sync WHERE endpoint_id = $1",
        )
        .bind(endpoint)
        .fetch_optional(pool)
        .await?;
        if let Some((Some(reloaded), Some(caught_up))) = done {
            if after.is_none_or(|after| reloaded > after) && caught_up >= reloaded {
                break reloaded;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let elapsed = started.elapsed().as_secs_f64();
    sequencer.stop().await;
    Ok((elapsed, finished))
}

/// A first load of `--reload-stories` stories into an empty copy, then a reload in full after
/// 10% of them changed and 5% closed (the second step reads each of those alone: 404).
async fn reload(global: &GlobalArgs, args: &StoriesBenchArgs) -> anyhow::Result<()> {
    let pool = fresh_database(global, args.recreate_database).await?;
    let tickers: Vec<String> = (0..args.tickers.max(1)).map(|t| format!("T{t}")).collect();
    let ticker_of = |i: usize| tickers[i % tickers.len()].clone();
    let n = args.reload_stories;
    let first: Vec<(String, String, u64)> = (0..n)
        .map(|i| (format!("st_{i}"), ticker_of(i), 1))
        .collect();
    let second: Vec<(String, String, u64)> = (0..n)
        .filter(|i| i % 20 != 19)
        .map(|i| {
            (
                format!("st_{i}"),
                ticker_of(i),
                if i % 10 == 0 { 2 } else { 1 },
            )
        })
        .collect();
    let endpoint = Uuid::new_v4();
    let (address, server) = serve_stories(first).await?;
    stories_tenant(
        &pool,
        &global.seal.keyring()?,
        &[endpoint],
        tickers.clone(),
        Some(&address),
    )
    .await?;
    let (load_s, loaded_at) = timed_reload(global, &args.sequencer, &pool, endpoint, None).await?;
    server.abort();

    let (address, server) = serve_stories(second.clone()).await?;
    sqlx::query("UPDATE webhook_endpoints SET upstream_base_url = $2 WHERE id = $1")
        .bind(endpoint)
        .bind(&address)
        .execute(&pool)
        .await?;
    sqlx::query("UPDATE stories_sync SET reload_needed = true WHERE endpoint_id = $1")
        .bind(endpoint)
        .execute(&pool)
        .await?;
    let changes_before: i64 = sqlx::query_scalar("SELECT count(*) FROM changes")
        .fetch_one(&pool)
        .await?;
    let (reload_s, _) =
        timed_reload(global, &args.sequencer, &pool, endpoint, Some(loaded_at)).await?;
    server.abort();
    let (open, closed, changes_after): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM stories WHERE NOT closed),
                (SELECT count(*) FROM stories WHERE closed),
                (SELECT count(*) FROM changes)",
    )
    .fetch_one(&pool)
    .await?;
    if open != second.len() as i64 || closed != (n - second.len()) as i64 {
        bail!(
            "after the reload the copy holds {open} open and {closed} closed, the API {} open",
            second.len()
        );
    }
    println!(
        "{}",
        json!({
            "bench": "stories_reload",
            "stories": n,
            "tickers": tickers.len(),
            "first_load_s": (load_s * 100.0).round() / 100.0,
            "reload_s": (reload_s * 100.0).round() / 100.0,
            "reload_open": open,
            "reload_closed": closed,
            "reload_changes": changes_after - changes_before,
        })
    );
    pool.close().await;
    Ok(())
}
