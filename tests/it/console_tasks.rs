//! The console's tasks in a real Chromium (as `console.rs`: Debian's chromium and
//! chromium-driver, the control plane with its own database):
//! - a message found by its webhook-id and opened (its body, headers and status); a find that
//!   answers 404 says so next to the field and leaves no earlier answer standing, for messages
//!   and for the copy alike;
//! - three quarantined messages selected and retried at once, each one's result shown;
//! - an endpoint registered (with a name and a pasted secret), a field the API refuses named
//!   next to that field, its settings edited, a secret rotated to one pasted (the API lists
//!   it; no secret is shown), and the endpoint deleted after a confirmation;
//! - the broker password rotated only after a confirmation saying every live consumer's
//!   connection is dropped and must reconnect with the new password;
//! - every view at 1280 and 375 px wide with a 200-character name, a 10,000-character headline
//!   and a 200-character webhook-id is no wider than the window, and bidirectional controls in
//!   names are shown as markers inside isolating elements.

use std::time::Duration;

use serde_json::{json, Value};
use uuid::Uuid;

use relay_store::messages::IncomingMessage;
use relay_tests::random_secret;

use crate::api::{apply_events, store_messages, ApiApp};
use crate::console::{Console, Driver};
use crate::sequencer_apply::{incoming, store_new};
use crate::stack::Api;

/// Sets `seqs` of the endpoint aside as the sequencer does when it cannot apply them.
async fn quarantine(app: &ApiApp, tenant: Uuid, endpoint: Uuid, seqs: &[i64]) {
    sqlx::query(
        "INSERT INTO quarantined_messages (endpoint_id, tenant_id, arrival_seq, reason, attempts)
         SELECT $1, $2, unnest($3::int8[]), 'the apply failed: value refused', 3",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(seqs)
    .execute(&app.db.pool)
    .await
    .unwrap();
}

async fn webhook_id_of(app: &ApiApp, endpoint: Uuid, seq: i64) -> String {
    sqlx::query_scalar(
        "SELECT webhook_id FROM messages WHERE endpoint_id = $1 AND arrival_seq = $2",
    )
    .bind(endpoint)
    .bind(seq)
    .fetch_one(&app.db.pool)
    .await
    .unwrap()
}

/// An item event of `subject` whose headline is `title`.
fn item(subject: &str, title: &str, seq: u64) -> Value {
    json!({"id": format!("evt_{subject}_{seq}"), "type": "announcement.updated", "subject": subject,
           "sequence": format!("0000000001.{seq:019}"), "specversion": "1.0",
           "data": {"type": "item", "feed_item_id": subject, "item_kind": "announcement",
                    "seq": seq, "first_seq": seq, "op": "new", "changes": [], "lang": "en",
                    "parts": [], "company": {"company_id": 28, "name": "Alfa Group AB"},
                    "head": {"title": title}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_finds_a_message_opens_it_and_retries_three_quarantined_at_once() {
    let app = ApiApp::spawn().await;
    let (tenant, token) = app.tenant("console-messages").await;
    let (endpoint, _) = app.endpoint(&token, json!({})).await;
    apply_events(
        &app.db,
        tenant,
        endpoint,
        &[item("announcement:1", "Alfa wins", 1)],
    )
    .await;
    let seqs = store_messages(&app.db, tenant, endpoint, 5).await;
    quarantine(&app, tenant, endpoint, &seqs[2..]).await;
    let wanted = webhook_id_of(&app, endpoint, seqs[0]).await;
    // One message whose body says something no other does.
    let body = json!({"v": 1, "webhook_endpoint_id": endpoint, "track": "feed", "generation": 1,
                      "events": [], "note": "the Needle-7f3a in the body"});
    let needle = store_new(
        &app.db.pool,
        &[incoming(
            tenant,
            endpoint,
            Some("feed".into()),
            Some(1),
            body.to_string().into_bytes(),
        )],
    )
    .await[0];

    let driver = Driver::start().await;
    let console = Console::new(&driver, &app.base_url).await;
    console.sign_in(&token).await;
    console.open(&format!("/endpoints/{endpoint}")).await;

    // The copy: an item found, then a subject that is not there: the 404 next to the field,
    // and the item found before gone.
    console.type_into("copy-search", "announcement:1").await;
    console.click("copy-search-go").await;
    console.wait("item").await;
    console.fill("copy-search", "announcement:404").await;
    console.click("copy-search-go").await;
    let error = console.text_of("copy-search-error").await;
    assert!(error.contains("404"), "{error}");
    assert!(!console.has("item").await, "the earlier item still shown");
    assert!(!console.has("error").await, "a field's error in the banner");

    // A search of the bodies: the one message that says it.
    console.type_into("messages-contains", "Needle-7f3a").await;
    console.click("messages-apply").await;
    console
        .until(
            "the one message found by its text",
            &format!(
                "const rows = document.querySelectorAll('[data-testid=\"message-row\"]');
                 return rows.length === 1 && rows[0].dataset.arrivalSeq === '{needle}';"
            ),
        )
        .await;

    // The activity of the last week: an hour a bucket, each with its values on hover.
    console
        .js(
            "const s = document.querySelector('[data-testid=\"activity-window\"]');
             s.value = 'week'; s.dispatchEvent(new Event('change')); return true;",
        )
        .await;
    console
        .until(
            "a week's chart",
            "return document.querySelectorAll('[data-testid=\"activity-chart\"] rect.hit > title').length === 168;",
        )
        .await;

    // Refresh reads everything again in place: the page stays where it was scrolled to.
    console.scroll_to("quarantine").await;
    let before = console.js("return window.scrollY;").await;
    console
        .js("document.querySelector('[data-testid=\"refresh\"]').click(); return true;")
        .await;
    console
        .until(
            "the refresh said done",
            "return document.getElementById('status').textContent === 'Endpoint refreshed.';",
        )
        .await;
    let after = console.js("return window.scrollY;").await;
    assert!(
        (before.as_f64().unwrap() - after.as_f64().unwrap()).abs() <= 2.0
            && after.as_f64().unwrap() > 0.0,
        "scrolled at {before} before the refresh, at {after} after"
    );

    // A message by its webhook-id: found, then opened.
    console.type_into("message-find-id", &wanted).await;
    console.click("message-find-go").await;
    console.wait("message-found").await;
    // Not there: said next to the field, the earlier answer gone.
    console.fill("message-find-id", "msg_not_stored").await;
    console.click("message-find-go").await;
    let error = console.text_of("message-find-error").await;
    assert!(error.contains("404"), "{error}");
    assert!(!console.has("message-found").await);
    console.fill("message-find-id", &wanted).await;
    console.click("message-find-go").await;
    assert!(
        !console.has("message-find-error").await || {
            console.gone("message-find-error").await;
            true
        }
    );
    console.click("message-found-link").await;
    let seq = console.text_of("message-arrival-seq").await;
    assert_eq!(seq.trim(), seqs[0].to_string(), "the id as plain digits");
    assert_eq!(console.text_of("message-webhook-id").await.trim(), wanted);
    let body = console.text_of("message-body").await;
    assert!(
        body.contains("\"events\""),
        "the body, pretty-printed: {body}"
    );
    let title = console.js("return document.title;").await;
    assert!(title.as_str().unwrap().starts_with("Message "), "{title}");
    let focused = console
        .js("return document.activeElement && document.activeElement.tagName;")
        .await;
    assert_eq!(focused, "H1", "focus on the view's heading");
    console.screenshot("message").await;

    // A quarantined message's page: its quarantine row, with Retry and Discard.
    console
        .open(&format!("/endpoints/{endpoint}/messages/{}", seqs[2]))
        .await;
    console
        .until(
            "the message's quarantine row",
            "return !!document.querySelector('[data-testid=\"message-quarantine-status\"]');",
        )
        .await;
    let status = console.text_of("message-quarantine-status").await;
    assert_eq!(status.trim(), "quarantined");
    assert!(console.has("message-retry").await && console.has("message-discard").await);

    // The quarantine: all three selected on the page and retried at once; each one's result.
    console.open(&format!("/endpoints/{endpoint}")).await;
    console
        .until(
            "the three quarantined",
            "return document.querySelectorAll('[data-testid=\"quarantine-row\"]').length === 3;",
        )
        .await;
    console.click("quarantine-select-all").await;
    console.scroll_to("quarantine").await;
    console.screenshot("quarantine-selected").await;
    console.click("quarantine-bulk-retry").await;
    console
        .until(
            "three results, each done",
            "const r = [...document.querySelectorAll('[data-testid=\"bulk-result\"]')];
             return r.length === 3 && r.every(c => c.dataset.result === 'done');",
        )
        .await;
    let retried = app
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{endpoint}/quarantine?status=retried"),
            &token,
            None,
        )
        .await;
    assert_eq!(retried["data"].as_array().unwrap().len(), 3, "{retried}");
    console
        .until(
            "the list read again: nothing quarantined",
            "return document.querySelectorAll('[data-testid=\"quarantine-row\"]').length === 0;",
        )
        .await;

    console.browser.close().await.unwrap();
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_registers_edits_and_deletes_an_endpoint_and_rotates_to_a_pasted_secret() {
    let app = ApiApp::spawn().await;
    let (_, token) = app.tenant("console-endpoints").await;
    let driver = Driver::start().await;
    let console = Console::new(&driver, &app.base_url).await;
    console.sign_in(&token).await;
    console.open("/endpoints").await;

    // Registered: an id generated in the page, a name, a language the API refuses first
    // (named next to its field), then one it takes; the secret pasted.
    console.click("endpoint-create-open").await;
    console.click("endpoint-new-id-generate").await;
    console.type_into("endpoint-new-name", "Nordic feed").await;
    console.fill("endpoint-new-lang", "Swedish").await;
    let pasted = random_secret().to_whsec();
    console.type_into("endpoint-new-secret", &pasted).await;
    console.click("endpoint-create").await;
    let error = console.text_of("endpoint-create-lang-error").await;
    assert!(error.contains("lang"), "{error}");
    console.fill("endpoint-new-lang", "sv").await;
    console.click("endpoint-create").await;
    console.wait("endpoint-created").await;
    console.gone("endpoint-create-lang-error").await;
    assert!(
        !console.has("endpoint-created-secret").await,
        "a pasted secret is not shown again"
    );
    let href = console
        .js("return document.querySelector('[data-testid=\"endpoint-created-link\"]').getAttribute('href');")
        .await;
    let id: Uuid = href
        .as_str()
        .unwrap()
        .rsplit('/')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let made = app
        .ok(200, "GET", &format!("/v1/endpoints/{id}"), &token, None)
        .await;
    assert_eq!(
        (made["name"].as_str(), made["lang"].as_str()),
        (Some("Nordic feed"), Some("sv")),
        "{made}"
    );
    console.screenshot("endpoint-created").await;

    // Edited on its page: a new name and language.
    console.click("endpoint-created-link").await;
    console.wait("endpoint-edit").await;
    let title = console.js("return document.title;").await;
    assert_eq!(title, "Endpoint Nordic feed \u{b7} relay console");
    console.click("endpoint-edit-open").await;
    console.fill("endpoint-edit-name", "Nordic feed (en)").await;
    console.fill("endpoint-edit-lang", "en").await;
    console.click("endpoint-edit-save").await;
    console.wait("endpoint-edit-saved").await;
    let edited = app
        .ok(200, "GET", &format!("/v1/endpoints/{id}"), &token, None)
        .await;
    assert_eq!(
        (edited["name"].as_str(), edited["lang"].as_str()),
        (Some("Nordic feed (en)"), Some("en")),
        "{edited}"
    );

    // A secret that is no secret: refused next to the field. Then one pasted as the upstream
    // shows it: the API lists two, and the page shows none.
    console
        .type_into("rotate-secret-value", "not-a-secret")
        .await;
    console.click("rotate-secret").await;
    let error = console.text_of("rotate-secret-error").await;
    assert!(error.contains("400"), "{error}");
    console
        .fill("rotate-secret-value", &random_secret().to_whsec())
        .await;
    console.click("rotate-secret").await;
    console.wait("rotation-answer").await;
    assert!(!console.has("rotate-secret-error").await);
    assert!(!console.has("new-secret").await, "a pasted secret is shown");
    let secrets = app
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{id}/secrets"),
            &token,
            None,
        )
        .await;
    assert_eq!(secrets.as_array().unwrap().len(), 2, "{secrets}");

    // Deleted after a confirmation; the list says so.
    console.click("endpoint-delete").await;
    let question = console.text_of("endpoint-delete-question").await;
    assert!(question.contains("cannot be undone"), "{question}");
    console.click("endpoint-delete-confirm").await;
    let status = console.text_of("endpoint-deleted").await;
    assert!(status.contains(&id.to_string()), "{status}");
    let gone = app
        .call("GET", &format!("/v1/endpoints/{id}"), Some(&token), None)
        .await;
    assert_eq!(gone.status, 404, "{}", gone.text);

    console.browser.close().await.unwrap();
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotating_the_broker_password_is_confirmed_saying_live_consumers_are_dropped() {
    let app = ApiApp::spawn_with_vhost().await;
    let (tenant, token) = app.tenant("console-broker").await;
    let _users = crate::tenant_broker::UsersGuard::of_tenants(&[tenant]);
    let driver = Driver::start().await;
    let console = Console::new(&driver, &app.base_url).await;
    console.sign_in(&token).await;
    console.open("/broker").await;
    console.click("broker-create").await;
    let first = console.text_of("broker-password").await;

    console.click("broker-rotate").await;
    let question = console.text_of("broker-rotate-question").await;
    assert!(
        question.contains("connection is dropped")
            && question.contains("reconnect with the new password"),
        "{question}"
    );
    console.screenshot("broker-rotate").await;
    // Cancelled: nothing changed.
    console.click("broker-rotate-cancel").await;
    console.gone("broker-rotate-question").await;
    assert_eq!(console.text_of("broker-password").await, first);
    // Confirmed: a new password, shown once.
    console.click("broker-rotate").await;
    console.click("broker-rotate-confirm").await;
    console
        .until(
            "a new password",
            &format!(
                "const p = document.querySelector('[data-testid=\"broker-password\"]');
                 return !!p && p.textContent.trim() !== {};",
                json!(first.trim())
            ),
        )
        .await;

    console.browser.close().await.unwrap();
    app.stop().await;
}

/// A name of `n` characters with a right-to-left override in it: "… gnp.exe" would read as
/// "exe.png" were it applied.
fn long_bidi_name(prefix: &str, n: usize) -> String {
    let mut name = format!("{prefix} invoice-\u{202E}gnp.exe ");
    while name.chars().count() < n {
        name.push_str("long-name ");
    }
    name.chars()
        .take(n)
        .collect::<String>()
        .trim_end()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_view_fits_the_window_with_long_and_bidi_text() {
    let app = ApiApp::spawn().await;
    let operator = Api::operator_token();
    let tenant_name = long_bidi_name("tenant", 200);
    let created = app
        .ok(
            201,
            "POST",
            "/v1/tenants",
            &operator,
            Some(&json!({"name": tenant_name})),
        )
        .await;
    let tenant: Uuid = created["id"].as_str().unwrap().parse().unwrap();
    let token = app
        .ok(
            201,
            "POST",
            &format!("/v1/tenants/{tenant}/tokens"),
            &operator,
            Some(&json!({})),
        )
        .await["token"]
        .as_str()
        .unwrap()
        .to_owned();
    let endpoint_name = long_bidi_name("endpoint", 200);
    let (endpoint, _) = app.endpoint(&token, json!({"name": endpoint_name})).await;
    let headline = "Alfa wins a very long contract ".repeat(400);
    let headline: String = headline.chars().take(10_000).collect();
    apply_events(
        &app.db,
        tenant,
        endpoint,
        &[item("announcement:7", &headline, 1)],
    )
    .await;
    let long_id = format!("msg_{}", "x".repeat(196));
    let body = json!({"v": 1, "webhook_endpoint_id": endpoint, "track": "feed", "generation": 1,
                      "events": [], "note": headline.clone()})
    .to_string();
    let seqs = store_new(
        &app.db.pool,
        &[IncomingMessage {
            webhook_id: long_id.clone(),
            ..incoming(
                tenant,
                endpoint,
                Some("feed".into()),
                Some(1),
                body.into_bytes(),
            )
        }],
    )
    .await;
    quarantine(&app, tenant, endpoint, &seqs).await;

    let driver = Driver::start().await;
    let views = [
        ("/endpoints".to_owned(), "endpoints-table"),
        (format!("/endpoints/{endpoint}"), "quarantine-row"),
        (
            format!("/endpoints/{endpoint}/messages/{}", seqs[0]),
            "message-body",
        ),
        ("/broker".to_owned(), "broker-credentials"),
    ];
    for (width, height) in [(1280, 900), (375, 800)] {
        let console = Console::sized(&driver, &app.base_url, width, height).await;
        console.sign_in(&token).await;
        for (route, ready) in &views {
            console.open(route).await;
            console.wait(ready).await;
            if route.ends_with(&endpoint.to_string()) {
                // The item with the long headline shown too, and the charts drawn.
                console.fill("copy-search", "announcement:7").await;
                console.click("copy-search-go").await;
                console.wait("item-title").await;
                console.wait("activity-chart").await;
            }
            fits(&console, route, width).await;
            bidi_shown_as_markers(&console, route).await;
        }
        if width == 375 {
            console.open(&format!("/endpoints/{endpoint}")).await;
            console.wait("quarantine-row").await;
            console.screenshot("endpoint-narrow").await;
        }
        // The operator's tenants.
        console.sign_in(&operator).await;
        console.open(&format!("/tenants/{tenant}")).await;
        console.wait("tenants-table").await;
        console
            .until(
                "the panel loaded",
                "return !!document.querySelector('[data-testid=\"mint-token\"]');",
            )
            .await;
        fits(&console, "/tenants", width).await;
        bidi_shown_as_markers(&console, "/tenants").await;
        console.browser.close().await.unwrap();
    }

    app.stop().await;
}

/// The page is no wider than the window.
async fn fits(console: &Console, route: &str, width: u32) {
    // A moment for the layout of what the last answers drew.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sizes = console
        .js(
            "return {scroll: document.documentElement.scrollWidth, inner: window.innerWidth,
                     widest: [...document.querySelectorAll('body *')]
                        .filter(e => e.getBoundingClientRect().right > window.innerWidth + 1
                                     && !e.closest('.table-wrap, pre'))
                        .slice(0, 5).map(e => e.tagName + '.' + e.className + ' ' + e.getAttribute('data-testid'))};",
        )
        .await;
    // On a phone's page a wider content widens the layout (innerWidth) too: both are checked
    // against the width asked for.
    let width = i64::from(width);
    assert!(
        sizes["scroll"].as_i64().unwrap() <= width && sizes["inner"].as_i64().unwrap() == width,
        "{route} at {width} px is wider than the window: {sizes}"
    );
}

/// Every right-to-left override on the page is a visible marker inside an isolating element,
/// and no raw bidi control is in the page's text.
async fn bidi_shown_as_markers(console: &Console, route: &str) {
    let page = console
        .js(
            "const markers = [...document.querySelectorAll('.bidi-control')];
             return {markers: markers.length,
                     isolated: markers.every(m => m.closest('bdi')),
                     raw: /[\\u202A-\\u202E\\u2066-\\u2069\\u200E\\u200F\\u061C]/.test(document.body.innerText),
                     shown: markers.length ? markers[0].textContent : null};",
        )
        .await;
    assert_eq!(
        page["raw"], false,
        "{route}: a bidi control applied: {page}"
    );
    assert!(page["markers"].as_i64().unwrap() > 0, "{route}: {page}");
    assert_eq!(page["isolated"], true, "{route}: {page}");
    assert_eq!(page["shown"], "\u{27e6}U+202E\u{27e7}", "{route}: {page}");
}
