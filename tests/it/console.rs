//! The web console (`/console/`) in a real Chromium (Debian's `chromium` and `chromium-driver`,
//! driven over WebDriver), against the control plane with its own database:
//! - a tenant signs in with its token and sees its endpoints, and only its own: another tenant's
//!   token sees none of them, and an endpoint of the first named in the URL is not found;
//! - an item whose headline and part carry `<script>` and `<img onerror>` renders as text: no
//!   script runs and no image is made, and the text shows the markup as it was sent;
//! - a form on another origin posting to the API (as a cross-site request forgery would)
//!   changes nothing: the endpoint stays active;
//! - every file of the console carries the Content Security Policy, and the page loads nothing
//!   from another origin.
//!
//! With `RELAY_CONSOLE_SCREENSHOTS=<dir>` the run saves a screenshot of each view it visits
//! there (`docs/console/` holds the ones the README shows).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::api::{apply_events, ApiApp};
use crate::scale_out::free_address;

/// What the hostile headline and part say: markup that would run or load, were it markup.
const HOSTILE_TITLE: &str = "<script>window.__pwned = 'title'</script>Alfa wins";
const HOSTILE_PART: &str = "<img src=x onerror=\"window.__pwned = 'part'\">Deliveries start";

/// `chromedriver` on a free port of this machine, ended with the value.
struct Driver {
    process: tokio::process::Child,
    url: String,
}

impl Driver {
    async fn start() -> Self {
        let address = free_address();
        let process = tokio::process::Command::new("chromedriver")
            .arg(format!("--port={}", address.port()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect(
                "the console tests need Chromium's WebDriver: apt-get install chromium \
                 chromium-driver (.ci/run installs them)",
            );
        let url = format!("http://{address}");
        let started = Instant::now();
        let http = reqwest::Client::new();
        // A bound for a driver that never starts, not a timing claim.
        while http.get(format!("{url}/status")).send().await.is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "chromedriver did not answer at {url}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Self { process, url }
    }

    /// A headless Chromium of its own.
    async fn browser(&self) -> Client {
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".into(),
            json!({"binary": "/usr/bin/chromium",
                   "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                            "--disable-dev-shm-usage", "--window-size=1280,900"]}),
        );
        // Plain HTTP to the driver on this machine: no TLS stack to pick.
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        ClientBuilder::new(connector)
            .capabilities(capabilities)
            .connect(&self.url)
            .await
            .expect("a Chromium session")
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.process.start_kill();
    }
}

/// The browser, the console's address, and where screenshots go.
struct Console {
    browser: Client,
    base_url: String,
    screenshots: Option<PathBuf>,
}

impl Console {
    /// Waits for the element with `data-testid="<id>"`.
    async fn wait(&self, id: &str) -> fantoccini::elements::Element {
        self.browser
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::Css(&format!("[data-testid=\"{id}\"]")))
            .await
            .unwrap_or_else(|error| panic!("no [data-testid={id}] on the page: {error}"))
    }

    /// Waits until `script` (the body of a function) returns true in the page.
    async fn until(&self, what: &str, script: &str) {
        let started = Instant::now();
        loop {
            let value = self.browser.execute(script, vec![]).await.unwrap();
            if value == Value::Bool(true) {
                return;
            }
            // A bound for a page that never gets there, not a timing claim.
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the page never showed {what}; its text:\n{}",
                self.text().await
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn text(&self) -> String {
        self.browser
            .execute("return document.body.innerText;", vec![])
            .await
            .unwrap()
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    async fn sign_in(&self, token: &str) {
        self.browser
            .goto(&format!("{}/console/", self.base_url))
            .await
            .unwrap();
        // A page left signed in keeps its token for the session: sign out first.
        if let Ok(out) = self
            .browser
            .find(Locator::Css("[data-testid=\"sign-out\"]"))
            .await
        {
            out.click().await.unwrap();
        }
        self.wait("token-input")
            .await
            .send_keys(token)
            .await
            .unwrap();
        self.wait("sign-in").await.click().await.unwrap();
        self.wait("who").await;
    }

    async fn open(&self, route: &str) {
        self.browser
            .goto(&format!("{}/console/#{route}", self.base_url))
            .await
            .unwrap();
    }

    async fn screenshot(&self, name: &str) {
        if let Some(dir) = &self.screenshots {
            let png = self.browser.screenshot().await.unwrap();
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(dir.join(format!("{name}.png")), png).unwrap();
        }
    }
}

/// An item event whose headline and part carry markup.
fn hostile_item(subject: &str) -> Value {
    json!({"id": "evt_hostile_1", "type": "announcement.updated", "subject": subject,
           "sequence": "0000000001.0000000000000000007", "specversion": "1.0",
           "data": {"type": "item", "feed_item_id": subject, "item_kind": "announcement",
                    "seq": 7, "first_seq": 7, "op": "new", "changes": [], "lang": "en",
                    "parts": [{"kind": "flash", "part_id": "flash:7", "part_version": 1,
                               "headline": HOSTILE_PART}],
                    "company": {"company_id": 28, "name": "Alfa Group AB"},
                    "head": {"title": HOSTILE_TITLE}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_sees_its_own_endpoints_as_text_and_nothing_forged_changes_them() {
    let app = ApiApp::spawn().await;
    let (tenant_a, token_a) = app.tenant("console-a").await;
    let (_, token_b) = app.tenant("console-b").await;
    let (endpoint_a, _) = app.endpoint(&token_a, json!({})).await;
    let (endpoint_b, _) = app.endpoint(&token_b, json!({})).await;
    let subject = "announcement:666";
    apply_events(&app.db, tenant_a, endpoint_a, &[hostile_item(subject)]).await;

    // Every file of the console carries the policy.
    for file in ["/console/", "/console/app.js", "/console/app.css"] {
        let answer = app
            .client
            .get(format!("{}{file}", app.base_url))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200, "{file}");
        let policy = answer.headers()["content-security-policy"]
            .to_str()
            .unwrap()
            .to_owned();
        assert!(
            policy.contains("script-src 'self'") && !policy.contains("unsafe-inline"),
            "{file}: {policy}"
        );
        assert_eq!(answer.headers()["x-content-type-options"], "nosniff");
    }

    let driver = Driver::start().await;
    let console = Console {
        browser: driver.browser().await,
        base_url: app.base_url.clone(),
        screenshots: std::env::var_os("RELAY_CONSOLE_SCREENSHOTS").map(PathBuf::from),
    };

    // Tenant A signs in and sees its endpoint, and not B's.
    console.sign_in(&token_a).await;
    console.open("/endpoints").await;
    console.wait("endpoints-table").await;
    let row_a = format!("[data-testid=\"endpoint-row\"][data-endpoint-id=\"{endpoint_a}\"]");
    console
        .until(
            "A's endpoint",
            &format!("return document.querySelector('{row_a}') !== null;"),
        )
        .await;
    let rows: Vec<String> = rows_shown(&console).await;
    assert_eq!(rows, [endpoint_a.to_string()], "A's endpoints table");
    console.screenshot("endpoints").await;

    // The hostile item: found by its subject, shown as text.
    console.open(&format!("/endpoints/{endpoint_a}")).await;
    console.wait("copy").await;
    console
        .wait("copy-search")
        .await
        .send_keys(subject)
        .await
        .unwrap();
    console.wait("copy-search-go").await.click().await.unwrap();
    console
        .until(
            "the item in the copy",
            &format!(
                "return [...document.querySelectorAll('[data-testid=\"copy\"] *')]\
                 .some(e => e.children.length === 0 && e.textContent.includes('{subject}'));"
            ),
        )
        .await;
    let item = console
        .browser
        .find(Locator::XPath(&format!(
            "//*[@data-testid='copy']//*[not(*) and contains(text(), '{subject}')]"
        )))
        .await
        .unwrap();
    item.click().await.unwrap();
    let json_text = console.wait("item-json").await.text().await.unwrap();
    assert!(json_text.contains(HOSTILE_TITLE), "{json_text}");
    console
        .until(
            "the parts' headlines",
            "return document.querySelector('[data-testid=\"item-parts\"]') !== null;",
        )
        .await;
    let parts = console.wait("item-parts").await.text().await.unwrap();
    assert!(
        parts.contains(HOSTILE_PART),
        "the part's headline as text: {parts}"
    );
    let page = console
        .browser
        .execute(
            "return {pwned: window.__pwned === undefined ? null : window.__pwned,
                     scripts: [...document.scripts].map(s => s.src),
                     images: document.images.length,
                     foreign: performance.getEntriesByType('resource')
                         .map(r => r.name).filter(n => !n.startsWith(location.origin))};",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(
        page["pwned"],
        Value::Null,
        "markup from the copy ran: {page}"
    );
    assert_eq!(
        page["images"], 0,
        "markup from the copy made an image: {page}"
    );
    assert_eq!(
        page["scripts"],
        json!([format!("{}/console/app.js", app.base_url)]),
        "{page}"
    );
    assert_eq!(
        page["foreign"],
        json!([]),
        "assets of another origin: {page}"
    );
    console.screenshot("endpoint").await;

    // Tenant B sees only its own endpoint, and A's is not found for it.
    console.sign_in(&token_b).await;
    console.open("/endpoints").await;
    console.wait("endpoints-table").await;
    let row_b = format!("[data-testid=\"endpoint-row\"][data-endpoint-id=\"{endpoint_b}\"]");
    console
        .until(
            "B's endpoint",
            &format!("return document.querySelector('{row_b}') !== null;"),
        )
        .await;
    assert_eq!(rows_shown(&console).await, [endpoint_b.to_string()]);
    console.open(&format!("/endpoints/{endpoint_a}")).await;
    let error = console.wait("error").await.text().await.unwrap();
    assert!(
        error.to_lowercase().contains("not found") || error.contains("404"),
        "A's endpoint seen with B's token: {error}"
    );
    assert!(
        !console.text().await.contains(subject),
        "B's page shows A's copy"
    );

    // A form on another origin posts to the API, as a forged request would: nothing changes.
    let forged = forging_site(&app.base_url, endpoint_a).await;
    console.browser.goto(&forged).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let endpoint = app
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{endpoint_a}"),
            &token_a,
            None,
        )
        .await;
    assert_eq!(
        endpoint["status"], "active",
        "a forged post paused it: {endpoint}"
    );

    console.browser.close().await.unwrap();
    app.stop().await;
}

/// The endpoint ids of the endpoints table's rows.
async fn rows_shown(console: &Console) -> Vec<String> {
    let ids = console
        .browser
        .execute(
            "return [...document.querySelectorAll('[data-testid=\"endpoint-row\"]')]\
             .map(r => r.dataset.endpointId);",
            vec![],
        )
        .await
        .unwrap();
    serde_json::from_value(ids).unwrap()
}

/// A page on another site (`localhost` rather than the API's 127.0.0.1) whose form posts to the
/// endpoint's pause as soon as it loads; its address.
async fn forging_site(api: &str, endpoint: Uuid) -> String {
    let page = format!(
        "<!doctype html><form id=f method=post action=\"{api}/v1/endpoints/{endpoint}/pause\">\
         <input name=paused value=true></form><script>document.getElementById('f').submit()\
         </script>"
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let app = axum::Router::new().route(
        "/",
        axum::routing::get(move || {
            let page = page.clone();
            async move { axum::response::Html(page) }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://localhost:{}/", address.port())
}
