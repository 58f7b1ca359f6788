//! /v1/feed pages: a pass read across a concurrent access change shows differing
//! access_versions (so a reader reads again); a quiet pass carries one access_version and is
//! exactly the oracle. Item reads: 200, 404 with access_version, and the load balancer's 404.

use std::collections::BTreeSet;

use relay_simulator::model::{Access, ChangeKind, Selection};
use relay_simulator::upstream::{ItemRead, Upstream};
use relay_simulator::Faults;
use relay_wire::{ItemKind, Sequence};
use serde_json::Value;
use uuid::Uuid;

use crate::common::{self, KEY};

fn with_items(count: usize) -> (Upstream, Uuid) {
    let (mut up, id) = common::upstream_with_endpoint(false);
    let companies: Vec<i64> = up.world.companies.keys().copied().collect();
    for n in 0..count {
        let company = companies[n % companies.len()];
        up.create_item(
            ItemKind::Announcement,
            company,
            &format!("item {n}"),
            1_791_439_200_000 + n as i64 * 1000,
        )
        .unwrap();
    }
    (up, id)
}

/// Reads every page; returns each page's access_version and the items read.
fn read_pass(
    up: &mut Upstream,
    limit: usize,
    between: &mut dyn FnMut(&mut Upstream, usize),
) -> (Vec<String>, Vec<(String, String)>) {
    let selection = Selection::all("en");
    let mut versions = Vec::new();
    let mut items = Vec::new();
    let mut cursor: Option<String> = None;
    for page_number in 0.. {
        if page_number > 0 {
            between(up, page_number);
        }
        let page = up
            .feed_page(KEY, &selection, cursor.as_deref(), limit, 0)
            .unwrap();
        versions.push(page["access_version"].as_str().unwrap().to_owned());
        for entry in page["data"].as_array().unwrap() {
            items.push((
                entry["subject"].as_str().unwrap().to_owned(),
                entry["sequence"].as_str().unwrap().to_owned(),
            ));
        }
        if page["has_more"] != true {
            break;
        }
        cursor = page["next_cursor"].as_str().map(str::to_owned);
    }
    (versions, items)
}

#[test]
fn a_quiet_pass_has_one_access_version_and_is_the_oracle() {
    let (mut up, id) = with_items(10);
    let (versions, items) = read_pass(&mut up, 3, &mut |_, _| {});
    assert_eq!(versions.len(), 4);
    assert!(versions.iter().all(|v| *v == versions[0]));
    let oracle = up.expected_copy(id);
    let read: Vec<(String, String)> = items;
    let want: Vec<(String, String)> = {
        let mut v: Vec<(String, String)> = oracle
            .iter()
            .map(|(s, (seq, _))| (s.clone(), seq.as_str().to_owned()))
            .collect();
        v.sort();
        v
    };
    let mut got = read.clone();
    got.sort();
    assert_eq!(got, want);
    let unique: BTreeSet<_> = read.iter().map(|(s, _)| s.clone()).collect();
    assert_eq!(unique.len(), read.len(), "stable order: no item twice");
}

#[test]
fn a_pass_across_an_access_change_shows_differing_versions() {
    // Changed by hand between pages.
    let (mut up, _) = with_items(10);
    let (versions, _) = read_pass(&mut up, 3, &mut |up, page| {
        if page == 2 {
            up.set_access(KEY, 28, Some(Access::Teaser), 0).unwrap();
        }
    });
    assert_eq!(versions[0], versions[1]);
    assert_ne!(
        versions[1], versions[2],
        "the change shows as differing access_versions"
    );
    // Reading again after the change: one access_version throughout.
    let (again, _) = read_pass(&mut up, 3, &mut |_, _| {});
    assert!(again.iter().all(|v| *v == versions[2]));

    // Changed by the fault knob, mid-reload: every page after the first changes access.
    let (mut up, id) = with_items(10);
    up.set_faults(Faults {
        access_change_mid_reload: 1.0,
        ..Faults::default()
    });
    let generation = up.generation(id).unwrap();
    let (versions, _) = read_pass(&mut up, 4, &mut |_, _| {});
    assert!(versions.windows(2).all(|w| w[0] != w[1]), "{versions:?}");
    assert!(
        up.generation(id).unwrap() > generation,
        "the key's endpoints were reset"
    );
}

#[test]
fn a_content_change_between_pages_keeps_the_access_version() {
    // Not an access change: items change, pages agree, and the reader relies on events.
    let (mut up, _) = with_items(6);
    let (versions, _) = read_pass(&mut up, 2, &mut |up, _| {
        common::change_item_88001(up, ChangeKind::StoryAdded, "s");
    });
    assert!(versions.iter().all(|v| *v == versions[0]));
}

#[test]
fn item_reads_answer_found_gone_and_load_balancer_404() {
    let (mut up, _) = with_items(2);
    let ItemRead::Found(found) = up.item_read(KEY, "announcement:88001", "sv", None).unwrap()
    else {
        panic!()
    };
    assert_eq!(found["item"]["lang"], "sv");
    assert_eq!(found["sequence"], Sequence::from_parts(1, 1001).as_str());
    common::change_item_88001(&mut up, ChangeKind::Withdrawn, "");
    let ItemRead::Gone(gone) = up.item_read(KEY, "announcement:88001", "en", None).unwrap() else {
        panic!()
    };
    assert_eq!(gone["error"], "not_found");
    assert!(gone["access_version"].is_string());
    up.set_faults(Faults {
        lb_404: 1.0,
        ..Faults::default()
    });
    assert_eq!(
        up.item_read(KEY, "announcement:88002", "en", None).unwrap(),
        ItemRead::LoadBalancer404
    );
}

#[tokio::test]
async fn over_http_pages_carry_access_versions_and_errors_have_their_shapes() {
    let (mut up, _) = with_items(7);
    up.set_faults(Faults {
        access_change_mid_reload: 1.0,
        lb_404: 0.0,
        ..Faults::default()
    });
    let (sim, addr) = common::serve(up).await;
    let client = reqwest::Client::new();
    let get = |path: String, token: Option<&'static str>| {
        let url = format!("http://{addr}{path}");
        common::call(&client, reqwest::Method::GET, url, token, None)
    };
    assert_eq!(get("/v1/feed".into(), None).await.0, 401);
    let (status, first) = get("/v1/feed?lang=en&limit=4".into(), Some(KEY)).await;
    assert_eq!(status, 200);
    let first: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(first["data"].as_array().unwrap().len(), 4);
    assert_eq!(first["has_more"], true);
    let cursor = first["next_cursor"].as_str().unwrap();
    let (_, second) = get(
        format!("/v1/feed?lang=en&limit=4&cursor={cursor}"),
        Some(KEY),
    )
    .await;
    let second: Value = serde_json::from_str(&second).unwrap();
    assert_ne!(first["access_version"], second["access_version"]);

    let (status, text) = get(
        "/v1/feed/items/announcement:99999?lang=en".into(),
        Some(KEY),
    )
    .await;
    assert_eq!(status, 404);
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"], "not_found");
    assert!(body["access_version"].is_string());

    sim.lock().set_faults(Faults {
        lb_404: 1.0,
        ..Faults::default()
    });
    let (status, text) = get(
        "/v1/feed/items/announcement:88001?lang=en".into(),
        Some(KEY),
    )
    .await;
    assert_eq!(status, 404);
    assert!(
        serde_json::from_str::<Value>(&text).is_err(),
        "plain text: {text}"
    );

    sim.lock().set_faults(Faults::default());
    let (status, text) = get(
        "/v1/feed/since?since=1.1000&lang=en&include_event_ids=true&limit=3".into(),
        Some(KEY),
    )
    .await;
    assert_eq!(status, 200);
    let since: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(since["data"].as_array().unwrap().len(), 3);
    assert_eq!(since["event_ids"].as_array().unwrap().len(), 3);
    assert_eq!(since["has_more"], true);
}

#[tokio::test]
async fn an_expired_cursor_answers_410_and_the_first_page_is_served_again() {
    let (mut up, _) = with_items(7);
    up.set_faults(Faults {
        cursor_expired: 1.0,
        ..Faults::default()
    });
    let (_sim, addr) = common::serve(up).await;
    let client = reqwest::Client::new();
    let get = |url: String| {
        let answer = common::call(&client, reqwest::Method::GET, url, Some(KEY), None);
        async move {
            let (status, text) = answer.await;
            (status, serde_json::from_str::<Value>(&text).unwrap())
        }
    };
    let (status, first) = get(format!("http://{addr}/v1/feed?lang=en&limit=4")).await;
    assert_eq!(status, 200, "a first page has no cursor to expire");
    let cursor = first["next_cursor"].as_str().unwrap().to_owned();
    let (status, body) = get(format!(
        "http://{addr}/v1/feed?lang=en&limit=4&cursor={cursor}"
    ))
    .await;
    assert_eq!(
        (status, body),
        (410, serde_json::json!({"error": "cursor_expired"}))
    );
    // Starting the pass again works: the first page needs no cursor.
    let (status, again) = get(format!("http://{addr}/v1/feed?lang=en&limit=4")).await;
    assert_eq!(status, 200);
    assert_eq!(again["data"], first["data"]);
}
