//! The console's views checked by axe-core (tests/console-a11y: `npm ci` there installs the
//! pinned version) in a real Chromium, in the light and the dark theme: no violation of impact
//! serious or critical on the sign-in page, the endpoints list, a feed endpoint's page, a
//! message's page, the broker page and the operator's tenants with one selected. The
//! violations found are printed whatever their impact.

use std::path::PathBuf;

use serde_json::{json, Value};

use crate::api::{apply_events, store_messages, ApiApp};
use crate::console::{Console, Driver};
use crate::stack::Api;

/// axe-core's script, as `npm ci` in tests/console-a11y installs it.
fn axe_source() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("console-a11y/node_modules/axe-core/axe.min.js");
    std::fs::read_to_string(&path).unwrap_or_else(|error| {
        panic!(
            "{}: {error}: run `npm ci` in tests/console-a11y (.ci/run does)",
            path.display()
        )
    })
}

/// Runs axe on the page: its violations, each with its id, impact and first nodes.
async fn violations(console: &Console, axe: &str) -> Vec<Value> {
    console
        .browser
        .execute(&format!("{axe}\nreturn true;"), vec![])
        .await
        .unwrap();
    let found = console
        .browser
        .execute_async(
            "const done = arguments[arguments.length - 1];
             axe.run(document, {resultTypes: ['violations']}).then(r => done(r.violations.map(v => ({
                 id: v.id, impact: v.impact, help: v.help,
                 nodes: v.nodes.slice(0, 3).map(n => n.target.join(' ') + ': ' + n.failureSummary)}))),
               e => done([{id: 'axe-failed', impact: 'critical', help: String(e)}]));",
            vec![],
        )
        .await
        .unwrap();
    serde_json::from_value(found).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_view_has_no_serious_or_critical_accessibility_violation_in_either_theme() {
    let axe = axe_source();
    let app = ApiApp::spawn().await;
    let (tenant, token) = app.tenant("console-a11y").await;
    let (endpoint, _) = app
        .endpoint(&token, json!({"name": "Accessible feed"}))
        .await;
    let event = json!({"id": "evt_a11y_1", "type": "announcement.updated", "subject": "announcement:1",
        "sequence": "0000000001.0000000000000000001", "specversion": "1.0",
        "data": {"type": "item", "feed_item_id": "announcement:1", "item_kind": "announcement",
                 "seq": 1, "first_seq": 1, "op": "new", "changes": [], "lang": "en", "parts": [],
                 "company": {"company_id": 28, "name": "Alfa Group AB"},
                 "head": {"title": "Alfa wins"}}});
    apply_events(&app.db, tenant, endpoint, &[event]).await;
    let seqs = store_messages(&app.db, tenant, endpoint, 3).await;
    let operator = Api::operator_token();
    let driver = Driver::start().await;

    let mut failures = Vec::new();
    for dark in [false, true] {
        let console = if dark {
            Console::dark(&driver, &app.base_url).await
        } else {
            Console::new(&driver, &app.base_url).await
        };
        let theme = if dark { "dark" } else { "light" };
        let mut check = |name: String, found: Vec<Value>| {
            for v in &found {
                println!("{theme} {name}: {v}");
            }
            let serious: Vec<&Value> = found
                .iter()
                .filter(|v| matches!(v["impact"].as_str(), Some("serious" | "critical")))
                .collect();
            if !serious.is_empty() {
                failures.push(format!("{theme} {name}: {serious:?}"));
            }
        };
        console.open("/").await;
        console.wait("token-input").await;
        check("sign-in".into(), violations(&console, &axe).await);

        console.sign_in(&token).await;
        let views = [
            ("/endpoints".to_owned(), "endpoints-table"),
            (format!("/endpoints/{endpoint}"), "message-row"),
            (
                format!("/endpoints/{endpoint}/messages/{}", seqs[0]),
                "message-body",
            ),
            ("/broker".to_owned(), "destination"),
        ];
        for (route, ready) in views {
            console.open(&route).await;
            console.wait(ready).await;
            console
                .until(
                    "the view loaded",
                    "return !document.querySelector('[data-testid=\"loading\"], .pending');",
                )
                .await;
            check(route, violations(&console, &axe).await);
        }

        console.sign_in(&operator).await;
        console.open(&format!("/tenants/{tenant}")).await;
        console.wait("tenants-table").await;
        console
            .until(
                "the panel loaded",
                "return !!document.querySelector('[data-testid=\"mint-token\"]');",
            )
            .await;
        check("/tenants".into(), violations(&console, &axe).await);
        console.browser.close().await.unwrap();
    }
    app.stop().await;
    assert!(
        failures.is_empty(),
        "serious or critical violations:\n{}",
        failures.join("\n")
    );
}
