//! The web console (`/console/`) in a real Chromium (Debian's `chromium` and `chromium-driver`,
//! driven over WebDriver), against the control plane with its own database:
//! - a tenant signs in with its token and sees its endpoints, and only its own: another tenant's
//!   token sees none of them, and an endpoint of the first named in the URL is not found;
//! - an endpoint's page draws its last hour's throughput and sampled apply lag, read from a
//!   route only its tenant
//!   reaches; its pause, resume and secret rotation do what the API then reports;
//! - a resync confirmed in the page begins a new epoch; a stories endpoint's page shows its
//!   tickers, a story whose headline carries markup (as text) and its notification;
//! - an item whose headline and part carry `<script>` and `<img onerror>` renders as text: no
//!   script runs and no image is made, and the text shows the markup as it was sent;
//! - a form on another origin posting to the API (as a cross-site request forgery would)
//!   changes nothing: the endpoint stays active;
//! - every file of the console carries the Content Security Policy, and the page loads nothing
//!   from another origin;
//! - an operator sees the tenants, creates one, mints its token (which works) and offboards it;
//! - with every tier behind it, the tenant creates its broker credentials in the page and the
//!   test connects with what the page shows, retries a quarantined message (it applies, and its
//!   change reaches the queue), and replays from a change_seq (the queue receives it again).
//!
//! With `RELAY_CONSOLE_SCREENSHOTS=<dir>` the run saves a screenshot of each view it visits
//! there (`docs/console/` holds the ones the README shows).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};
use uuid::Uuid;

use relay_netguard::OutboundPolicy;
use relay_sequencer::{SequencerConfig, SequencerMetrics};
use relay_simulator::Faults;
use relay_tests::{TestApp, TestDb};

use crate::api::{apply_events, store_messages, ApiApp};
use crate::scale_out::free_address;
use crate::sequencer_quarantine::{
    in_sync_endpoint, refuse_poison, sequencer_config, store_updates,
};
use crate::stack::{
    copy_items, oracle, publisher_config, quiesce, serve_simulation, simulation, start_publisher,
    start_sequencer_with, stop_simulation, upstream_listener, Api, Room,
};
use crate::tenant_broker::{connect, consume, next_delivery, UsersGuard};

/// What the hostile headline and part say: markup that would run or load, were it markup.
const HOSTILE_TITLE: &str = "<script>window.__pwned = 'title'</script>Alfa wins";
const HOSTILE_PART: &str = "<img src=x onerror=\"window.__pwned = 'part'\">Deliveries start";

/// `chromedriver` on a free port of this machine, ended with the value.
pub(crate) struct Driver {
    process: tokio::process::Child,
    url: String,
}

impl Driver {
    pub(crate) async fn start() -> Self {
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

    /// A headless Chromium of its own, 1280 px wide.
    pub(crate) async fn browser(&self) -> Client {
        self.browser_with(json!({"binary": "/usr/bin/chromium",
                                 "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                                          "--disable-dev-shm-usage", "--window-size=1280,900"]}))
            .await
    }

    /// A headless Chromium whose page is `width` CSS pixels wide (a phone's 375 too: a window
    /// is at least 500 px wide, so the page's size is emulated).
    pub(crate) async fn browser_sized(&self, width: u32, height: u32) -> Client {
        self.browser_with(json!({"binary": "/usr/bin/chromium",
                                 "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                                          "--disable-dev-shm-usage", "--window-size=1280,900"],
                                 "mobileEmulation": {"deviceMetrics": {
                                     "width": width, "height": height, "pixelRatio": 1.0}}}))
            .await
    }

    pub(crate) async fn browser_with(&self, options: Value) -> Client {
        let mut capabilities = serde_json::Map::new();
        capabilities.insert("goog:chromeOptions".into(), options);
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
pub(crate) struct Console {
    pub(crate) browser: Client,
    pub(crate) base_url: String,
    screenshots: Option<PathBuf>,
}

impl Console {
    /// A browser of `driver`'s on the control plane at `base_url`, saving screenshots where
    /// RELAY_CONSOLE_SCREENSHOTS names.
    pub(crate) async fn new(driver: &Driver, base_url: &str) -> Self {
        Self {
            browser: driver.browser().await,
            base_url: base_url.to_owned(),
            screenshots: std::env::var_os("RELAY_CONSOLE_SCREENSHOTS").map(PathBuf::from),
        }
    }

    /// As [`Console::new`], in the dark theme (the page sees `prefers-color-scheme: dark`).
    pub(crate) async fn dark(driver: &Driver, base_url: &str) -> Self {
        Self {
            browser: driver
                .browser_with(json!({"binary": "/usr/bin/chromium",
                                     "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                                              "--disable-dev-shm-usage", "--window-size=1280,900",
                                              "--force-dark-mode"]}))
                .await,
            base_url: base_url.to_owned(),
            screenshots: std::env::var_os("RELAY_CONSOLE_SCREENSHOTS").map(PathBuf::from),
        }
    }

    /// As [`Console::new`], the page `width` CSS pixels wide.
    pub(crate) async fn sized(driver: &Driver, base_url: &str, width: u32, height: u32) -> Self {
        Self {
            browser: driver.browser_sized(width, height).await,
            base_url: base_url.to_owned(),
            screenshots: std::env::var_os("RELAY_CONSOLE_SCREENSHOTS").map(PathBuf::from),
        }
    }

    /// Opens the endpoints page and waits until its table lists `endpoint`.
    pub(crate) async fn endpoints_listing(&self, endpoint: Uuid) {
        self.open("/endpoints").await;
        self.wait("endpoints-table").await;
        let row = format!("[data-testid=\"endpoint-row\"][data-endpoint-id=\"{endpoint}\"]");
        self.until(
            &format!("endpoint {endpoint} listed"),
            &format!("return document.querySelector('{row}') !== null;"),
        )
        .await;
    }

    /// Scrolls the element with `data-testid="<id>"` into view (before a screenshot).
    pub(crate) async fn scroll_to(&self, id: &str) {
        self.browser
            .execute(
                &format!(
                    "document.querySelector('[data-testid=\"{id}\"]').scrollIntoView(); \
                     return true;"
                ),
                vec![],
            )
            .await
            .unwrap();
    }

    /// Waits for the element with `data-testid="<id>"`.
    pub(crate) async fn wait(&self, id: &str) -> fantoccini::elements::Element {
        self.browser
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::Css(&format!("[data-testid=\"{id}\"]")))
            .await
            .unwrap_or_else(|error| panic!("no [data-testid={id}] on the page: {error}"))
    }

    /// Waits until `script` (the body of a function) returns true in the page.
    pub(crate) async fn until(&self, what: &str, script: &str) {
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

    pub(crate) async fn text(&self) -> String {
        self.browser
            .execute("return document.body.innerText;", vec![])
            .await
            .unwrap()
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Signs in with `token` from a fresh session (what was signed in before is forgotten).
    pub(crate) async fn sign_in(&self, token: &str) {
        let page = format!("{}/console/", self.base_url);
        self.browser.goto(&page).await.unwrap();
        self.browser
            .execute("sessionStorage.clear(); return true;", vec![])
            .await
            .unwrap();
        self.browser.goto(&format!("{page}#/")).await.unwrap();
        self.browser.refresh().await.unwrap();
        self.type_into("token-input", token).await;
        self.click("sign-in").await;
        self.wait("who").await;
    }

    /// Types `text` into `[data-testid=<id>]`, again if the page drew the element anew meanwhile.
    pub(crate) async fn type_into(&self, id: &str, text: &str) {
        for _ in 0..5 {
            match self.wait(id).await.send_keys(text).await {
                Err(fantoccini::error::CmdError::Standard(e))
                    if e.error == fantoccini::error::ErrorStatus::StaleElementReference => {}
                other => return other.unwrap(),
            }
        }
        panic!("[data-testid={id}] kept being drawn anew");
    }

    /// The text of `[data-testid=<id>]`, read again if the page drew the element anew meanwhile.
    pub(crate) async fn text_of(&self, id: &str) -> String {
        for _ in 0..5 {
            match self.wait(id).await.text().await {
                Err(fantoccini::error::CmdError::Standard(e))
                    if e.error == fantoccini::error::ErrorStatus::StaleElementReference => {}
                other => return other.unwrap(),
            }
        }
        panic!("[data-testid={id}] kept being drawn anew");
    }

    /// Clicks `[data-testid=<id>]`, again if the page drew the element anew meanwhile.
    pub(crate) async fn click(&self, id: &str) {
        self.click_at(&format!("[data-testid=\"{id}\"]")).await;
    }

    /// Clicks the element `css` selects, again if the page drew it anew meanwhile.
    pub(crate) async fn click_at(&self, css: &str) {
        self.click_on(Locator::Css(css)).await;
    }

    /// Clicks the element `locator` finds, again if the page drew it anew meanwhile.
    pub(crate) async fn click_on(&self, locator: Locator<'_>) {
        for _ in 0..5 {
            let element = self
                .browser
                .wait()
                .at_most(Duration::from_secs(20))
                .for_element(locator)
                .await
                .unwrap_or_else(|error| panic!("no {locator:?} on the page: {error}"));
            match element.click().await {
                Err(fantoccini::error::CmdError::Standard(e))
                    if e.error == fantoccini::error::ErrorStatus::StaleElementReference => {}
                other => return other.unwrap(),
            }
        }
        panic!("{locator:?} kept being drawn anew");
    }

    pub(crate) async fn open(&self, route: &str) {
        self.browser
            .goto(&format!("{}/console/#{route}", self.base_url))
            .await
            .unwrap();
    }

    /// Runs `script` (a function's body) in the page: what it returns.
    pub(crate) async fn js(&self, script: &str) -> Value {
        self.browser.execute(script, vec![]).await.unwrap()
    }

    /// Whether an element with `data-testid="<id>"` is on the page now.
    pub(crate) async fn has(&self, id: &str) -> bool {
        self.js(&format!(
            "return document.querySelector('[data-testid=\"{id}\"]') !== null;"
        ))
        .await
            == Value::Bool(true)
    }

    /// Clears the field `[data-testid=<id>]` and types `text` into it.
    pub(crate) async fn fill(&self, id: &str, text: &str) {
        self.wait(id).await.clear().await.unwrap();
        self.type_into(id, text).await;
    }

    /// Waits until the element `[data-testid=<id>]` is gone from the page.
    pub(crate) async fn gone(&self, id: &str) {
        self.until(
            &format!("[data-testid={id}] gone"),
            &format!("return document.querySelector('[data-testid=\"{id}\"]') === null;"),
        )
        .await;
    }

    pub(crate) async fn screenshot(&self, name: &str) {
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
    // Three messages stored and not applied (no sequencer runs here): waiting, so a sample of
    // the apply lag, as the sequencers take them, finds A's endpoint behind.
    store_messages(&app.db, tenant_a, endpoint_a, 3).await;
    let (sampled, _) = relay_store::lag_samples::sample(&app.db.pool)
        .await
        .unwrap();
    // A's endpoint has messages waiting (B's, with none, may be sampled for its counters).
    assert!(sampled >= 1, "A's endpoint sampled: {sampled}");

    // Every file of the console carries the policy: the page, its style, and every module the
    // script imports, followed from app.js as the browser follows them.
    for (file, content_type) in console_files(&app.client, &app.base_url).await {
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
        assert_eq!(
            answer.headers()["content-type"].to_str().unwrap(),
            content_type,
            "{file}"
        );
    }

    let driver = Driver::start().await;
    let console = Console::new(&driver, &app.base_url).await;

    // Tenant A signs in and sees its endpoint, and not B's.
    console.sign_in(&token_a).await;
    console.endpoints_listing(endpoint_a).await;
    let rows: Vec<String> = rows_shown(&console).await;
    assert_eq!(rows, [endpoint_a.to_string()], "A's endpoints table");
    console.screenshot("endpoints").await;

    // The hostile item: found by its subject, shown as text.
    console.open(&format!("/endpoints/{endpoint_a}")).await;
    console.wait("copy").await;
    console.type_into("copy-search", subject).await;
    console.click("copy-search-go").await;
    console
        .until(
            "the item in the copy",
            &format!(
                "return [...document.querySelectorAll('[data-testid=\"copy\"] *')]\
                 .some(e => e.children.length === 0 && e.textContent.includes('{subject}'));"
            ),
        )
        .await;
    let xpath = format!("//*[@data-testid='copy']//*[not(*) and contains(text(), '{subject}')]");
    console.click_on(Locator::XPath(&xpath)).await;
    let json_text = console.text_of("item-json").await;
    assert!(json_text.contains(HOSTILE_TITLE), "{json_text}");
    console
        .until(
            "the parts' headlines",
            "return document.querySelector('[data-testid=\"item-parts\"]') !== null;",
        )
        .await;
    let parts = console.text_of("item-parts").await;
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

    // The last hour's throughput: the page's chart, and the route it draws from, for A only.
    console.wait("activity-chart").await;
    let activity = app
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{endpoint_a}/activity"),
            &token_a,
            None,
        )
        .await;
    // `buckets` (hour, day or week); `minutes` from a control plane before them.
    let minutes = activity
        .get("buckets")
        .unwrap_or(&activity["minutes"])
        .as_array()
        .unwrap();
    assert_eq!(minutes.len(), 60, "{activity}");
    let sum = |key: &str| -> i64 { minutes.iter().map(|m| m[key].as_i64().unwrap()).sum() };
    assert_eq!(
        sum("written"),
        1,
        "the hostile item's one change: {activity}"
    );
    assert_eq!(sum("received"), 3, "the three messages stored: {activity}");
    let lag = minutes
        .iter()
        .map(|m| m["apply_lag_s"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(
        lag > 0.0,
        "the oldest waiting message's age, sampled: {activity}"
    );
    console.wait("lag-chart").await;
    // Each minute's values on hover (an SVG title a minute) and in the readout beside the
    // chart as the keyboard moves through it; the times in the reader's zone, named.
    let chart = console
        .js(
            "const c = document.querySelector('[data-testid=\"activity-chart\"]');
             c.focus();
             c.dispatchEvent(new KeyboardEvent('keydown', {key: 'ArrowLeft', bubbles: true}));
             return {titles: c.querySelectorAll('rect.hit > title').length,
                     readout: document.querySelector('[data-testid=\"activity-chart-readout\"]').textContent,
                     label: c.getAttribute('aria-label')};",
        )
        .await;
    assert_eq!(chart["titles"], 60, "{chart}");
    let readout = chart["readout"].as_str().unwrap();
    assert!(
        readout.contains("received") && readout.contains("written"),
        "{chart}"
    );
    assert!(
        chart["label"].as_str().unwrap().contains("times in"),
        "{chart}"
    );
    console.scroll_to("activity").await;
    console.screenshot("activity").await;
    let theirs = app
        .call(
            "GET",
            &format!("/v1/endpoints/{endpoint_a}/activity"),
            Some(&token_b),
            None,
        )
        .await;
    assert_eq!(theirs.status, 404, "{}", theirs.text);

    // Pause and resume from the page, as the API then says.
    let endpoint_status = |want: &str| {
        format!(
            "return (document.querySelector('[data-testid=\"endpoint-status\"]') || {{}})\
             .textContent.trim() === '{want}';"
        )
    };
    let status_of = || async {
        app.ok(
            200,
            "GET",
            &format!("/v1/endpoints/{endpoint_a}"),
            &token_a,
            None,
        )
        .await["status"]
            .clone()
    };
    console.click("pause").await;
    console.until("paused", &endpoint_status("paused")).await;
    assert_eq!(status_of().await, "paused");
    console.click("resume").await;
    console.until("active", &endpoint_status("active")).await;
    assert_eq!(status_of().await, "active");

    // A new signing secret, made in the browser and shown once; the endpoint holds two now.
    console.click("rotate-secret").await;
    let shown = console.text_of("new-secret").await;
    assert!(
        shown
            .split_whitespace()
            .any(|w| w.starts_with("whsec_") && w.len() > 40),
        "{shown}"
    );
    let secrets = app
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{endpoint_a}/secrets"),
            &token_a,
            None,
        )
        .await;
    let secrets = secrets
        .get("data")
        .unwrap_or(&secrets)
        .as_array()
        .unwrap()
        .len();
    assert_eq!(secrets, 2, "the first secret and the rotated one");

    // A resync from the stream section, confirmed in the page: a new epoch, as the API says.
    let epoch_before = app
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{endpoint_a}/state"),
            &token_a,
            None,
        )
        .await["change_epoch"]
        .clone();
    console.click("resync").await;
    console.click("resync-confirm").await;
    console.wait("resync-answer").await;
    let epoch_after = app
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{endpoint_a}/state"),
            &token_a,
            None,
        )
        .await["change_epoch"]
        .clone();
    assert!(
        epoch_after.as_i64() > epoch_before.as_i64(),
        "resynced from {epoch_before} to {epoch_after}"
    );

    // A stories endpoint: its tickers, a story whose headline carries markup (as text), and
    // the notification it claimed.
    let stories = stories_endpoint_with_a_hostile_story(&app, tenant_a, &token_a).await;
    console.open(&format!("/endpoints/{stories}")).await;
    console
        .until(
            "the story and its notification",
            "return !!document.querySelector('[data-testid=\"story-headline\"]') \
             && !!document.querySelector('[data-testid=\"notification-row\"]');",
        )
        .await;
    let tickers = console.text_of("tickers").await;
    assert!(tickers.contains("ALFA B"), "{tickers}");
    let headline = console.text_of("story-headline").await;
    assert_eq!(headline.trim(), HOSTILE_TITLE);
    let page = console
        .browser
        .execute(
            "return {pwned: window.__pwned === undefined ? null : window.__pwned,
                     images: document.images.length};",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(
        page,
        json!({"pwned": null, "images": 0}),
        "markup from a story ran"
    );
    console.scroll_to("stories").await;
    console.screenshot("stories").await;

    // Tenant B sees only its own endpoint, and A's is not found for it.
    console.sign_in(&token_b).await;
    console.endpoints_listing(endpoint_b).await;
    assert_eq!(rows_shown(&console).await, [endpoint_b.to_string()]);
    console.open(&format!("/endpoints/{endpoint_a}")).await;
    let error = console.text_of("error").await;
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

    // An operator: the tenants, a new one and its token (shown once, and it works), offboarding.
    let operator = Api::operator_token();
    console.sign_in(&operator).await;
    console.open("/tenants").await;
    console.wait("tenants-table").await;
    console
        .until(
            "both tenants",
            "return document.querySelectorAll('[data-testid=\"tenant-row\"]').length >= 2;",
        )
        .await;
    console.type_into("tenant-name", "console-c").await;
    console.click("tenant-create").await;
    console.click("mint-token").await;
    let minted = console.text_of("minted-token").await;
    let own = app.ok(200, "GET", "/v1/tenant", minted.trim(), None).await;
    assert_eq!(own["name"], "console-c", "{own}");
    let made = own["id"].as_str().unwrap().to_owned();
    console.screenshot("tenants").await;
    console.click("offboard").await;
    let question = console.text_of("offboard-question").await;
    assert!(question.contains("cannot be undone"), "{question}");
    console.click("offboard-confirm").await;
    // The panel closes: none of its buttons stays live; the list no longer shows the tenant.
    let status = console.text_of("offboard-status").await;
    assert!(status.contains("offboarded"), "{status}");
    console.gone("tenant-panel").await;
    assert!(!console.has("offboard").await && !console.has("mint-token").await);
    console
        .until(
            "the offboarded tenant gone from the list",
            &format!(
                "return !document.querySelector('[data-testid=\"tenant-row\"][data-tenant-id=\"{made}\"]') \
                 && document.querySelectorAll('[data-testid=\"tenant-row\"]').length >= 2;"
            ),
        )
        .await;
    // Offboarded: a tenant being deleted (or gone) is not found.
    let gone = app
        .call("GET", &format!("/v1/tenants/{made}"), Some(&operator), None)
        .await;
    assert_eq!(gone.status, 404, "the offboarded tenant: {}", gone.text);

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

/// The console's files, as the browser reaches them: the page, what it links, and every module
/// imported from app.js on (followed through their `from '...'` specifiers); each with the
/// content type it must be served with.
pub(crate) async fn console_files(
    client: &reqwest::Client,
    base_url: &str,
) -> Vec<(String, &'static str)> {
    let mut files = vec![
        ("/console/".to_owned(), "text/html; charset=utf-8"),
        ("/console/app.css".to_owned(), "text/css; charset=utf-8"),
    ];
    let mut queue = vec!["/console/app.js".to_owned()];
    let mut seen = std::collections::BTreeSet::new();
    while let Some(module) = queue.pop() {
        if !seen.insert(module.clone()) {
            continue;
        }
        let source = client
            .get(format!("{base_url}{module}"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let dir = &module[..=module.rfind('/').unwrap()];
        // An import's (or re-export's) last line: `import { a } from './a.js';` or
        // `} from '../b.js';`.
        let specs = source.lines().filter_map(|line| {
            let line = line.trim_start();
            let statement =
                line.starts_with("import ") || line.starts_with("export ") || line.starts_with('}');
            let (_, tail) = line.split_once(" from '").filter(|_| statement)?;
            tail.split_once('\'').map(|(spec, _)| spec)
        });
        for spec in specs {
            let mut parts: Vec<&str> = dir.split('/').filter(|p| !p.is_empty()).collect();
            for step in spec.split('/') {
                match step {
                    "." | "" => {}
                    ".." => {
                        parts.pop();
                    }
                    other => parts.push(other),
                }
            }
            queue.push(format!("/{}", parts.join("/")));
        }
        files.push((module, "text/javascript; charset=utf-8"));
    }
    assert!(files.len() > 10, "the modules the console loads: {files:?}");
    files
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

/// The whole path behind the console with the simulator's traffic: the front tier, a
/// sequencer that quarantines a message at its first failure, a publisher to the room's vhost,
/// and the simulated upstream sending two feed endpoints' webhooks over HTTP (faults on). In
/// the browser the tenant sees its three endpoints, creates its broker credentials (the test
/// connects with what the page shows), retries the third endpoint's quarantined message once
/// the cause is gone (it applies, and its change reaches the queue), and replays from
/// change_seq 1 (the queue receives change 1 again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_retries_a_quarantined_message_replays_and_reads_its_queue_from_the_console() {
    let seed = relay_tests::printed_seed("console with traffic");
    let room = Room::new().await;
    let db = TestDb::new().await;
    let db_url = db.url.clone();
    let (prefix, amqp_url) = (room.prefix.0.clone(), room.vhost.url());
    // An event id starting "poison" fails the apply, as a value Postgres refuses would.
    refuse_poison(&db.pool, ("applied_events", "event_id"), "event").await;
    let ingest = TestApp::spawn_waking_on(db, &prefix).await;
    let pool = ingest.db.pool.clone();
    let api = Api::start(&db_url, &amqp_url, OutboundPolicy::ANY).await;
    let sequencer = start_sequencer_with(
        &db_url,
        SequencerConfig {
            apply_attempts: 1,
            ..sequencer_config(&prefix)
        },
        SequencerMetrics::unregistered(),
    )
    .await;
    let (publisher, _) = start_publisher(&pool, publisher_config(amqp_url, &prefix)).await;

    // The tenant, its two simulated endpoints (registered through the API with the upstream's
    // URL and key), and a third in sync that the test stores messages for.
    let (sim_listener, upstream_api) = upstream_listener("127.0.0.1").await;
    let faults = Faults {
        duplicate: 0.1,
        refetch: 0.2,
        ..Faults::default()
    };
    let (upstream, workload, infos) = simulation(seed, &ingest.base_url, 2, faults);
    let (tenant, token) = api.tenant("console with traffic").await;
    let _users = UsersGuard::of_tenants(&[tenant]);
    for info in &infos {
        api.register(&token, info, &upstream_api).await;
    }
    let endpoint = in_sync_endpoint(&pool, tenant, None).await;
    let (sim, senders) = serve_simulation(upstream, Duration::from_secs(2), sim_listener).await;
    let traffic = tokio::spawn(
        sim.clone()
            .run_workload(workload, 20.0, Duration::from_secs(6)),
    );

    let driver = Driver::start().await;
    let console = Console::new(&driver, &api.base_url).await;
    console.sign_in(&token).await;
    console.open("/endpoints").await;
    console
        .until(
            "the tenant's three endpoints",
            "return document.querySelectorAll('[data-testid=\"endpoint-row\"]').length === 3;",
        )
        .await;
    let mut shown = rows_shown(&console).await;
    shown.sort();
    let mut expected: Vec<String> = infos
        .iter()
        .map(|i| i.id.to_string())
        .chain([endpoint.to_string()])
        .collect();
    expected.sort();
    assert_eq!(shown, expected, "seed {seed}");

    // Broker credentials, made in the page; the password is shown once, beside the URL.
    console.open("/broker").await;
    console.click("broker-create").await;
    let password = console.text_of("broker-password").await;
    let url = console.text_of("broker-url").await;
    let queues = console.text_of("broker-queues").await;
    let queue = relay_publisher::tenant_queue(tenant);
    assert!(queues.contains(&queue), "{queues}");
    console.screenshot("broker").await;
    let tenant_url =
        crate::tenant_broker::tenant_url(&json!({"amqp_url": url.trim()}), password.trim());
    let connection = connect(&tenant_url)
        .await
        .expect("the credentials the page showed connect");
    let mut consumer = consume(&connection, &queue, "console", "the tenant's own queue").await;

    // Three messages for the third endpoint; the second fails and is quarantined, the third
    // applies. The simulated endpoints' changes share the queue: the test reads past them.
    let seqs = store_updates(
        &pool,
        tenant,
        endpoint,
        &[("evt_1", 1, 10), ("poison_2", 2, 11), ("evt_3", 3, 12)],
    )
    .await;
    let first = next_change_of(&mut consumer, endpoint, "the live changes").await;
    let second = next_change_of(&mut consumer, endpoint, "the live changes").await;
    assert_eq!(
        [first, second],
        [
            (1, "announcement:1".to_owned()),
            (2, "announcement:3".to_owned())
        ],
        "seed {seed}"
    );

    // The cause goes; the tenant finds the message in its quarantine and retries it.
    sqlx::query("DROP TRIGGER refuse_poison ON applied_events")
        .execute(&pool)
        .await
        .unwrap();
    console.open(&format!("/endpoints/{endpoint}")).await;
    let row = format!(
        "[data-testid=\"quarantine-row\"][data-arrival-seq=\"{}\"]",
        seqs[1]
    );
    console
        .until(
            "the quarantined message",
            &format!("return document.querySelector('{row}') !== null;"),
        )
        .await;
    console.screenshot("quarantine").await;
    console
        .click_at(&format!("{row} [data-testid=\"retry\"]"))
        .await;
    console.wait("quarantine-answer").await;
    let retried = next_change_of(&mut consumer, endpoint, "the retried message's change").await;
    assert_eq!(retried, (3, "announcement:2".to_owned()), "seed {seed}");
    assert!(copy_items(&pool, endpoint)
        .await
        .contains_key("announcement:2"));

    // A replay from change_seq 1: the queue receives change 1 again.
    console.type_into("replay-from", "1").await;
    console.click("replay").await;
    let answer = console.text_of("replay-answer").await;
    let replayed = next_change_of(&mut consumer, endpoint, "the replayed change").await;
    assert_eq!(replayed, (1, "announcement:1".to_owned()), "{answer}");
    console.screenshot("stream").await;

    // The simulated endpoints' traffic went through all along: each copy is the oracle's.
    traffic.await.unwrap();
    let ids: Vec<Uuid> = infos.iter().map(|i| i.id).collect();
    quiesce(&pool, &sim, &ids, Duration::from_secs(120), seed).await;
    for &id in &ids {
        assert_eq!(
            copy_items(&pool, id).await,
            oracle(&sim, id),
            "seed {seed}: endpoint {id}'s copy"
        );
    }

    console.browser.close().await.unwrap();
    let _ = connection.close(200, "done").await;
    stop_simulation(&sim, senders).await;
    publisher.stop().await;
    sequencer.stop().await;
    api.stop().await;
    drop(ingest);
}

/// The next change of `endpoint` from the tenant's queue (others acknowledged and passed by):
/// its change_seq and subject.
async fn next_change_of(
    consumer: &mut relay_publisher::lapin::Consumer,
    endpoint: Uuid,
    what: &str,
) -> (i64, String) {
    loop {
        let delivery = next_delivery(consumer, what).await;
        delivery
            .ack(relay_publisher::lapin::options::BasicAckOptions::default())
            .await
            .unwrap();
        let body: Value = serde_json::from_slice(&delivery.data).unwrap();
        if body["webhook_endpoint_id"] == endpoint.to_string().as_str() {
            return (
                body["change_seq"].as_i64().unwrap(),
                body["subject"].as_str().unwrap_or_default().to_owned(),
            );
        }
    }
}

/// Endpoints of the benchmark's tenant, and messages stored for each.
const BENCH_ENDPOINTS: i64 = 1_000;
const BENCH_MESSAGES_PER_ENDPOINT: i64 = 1_000;
/// Rounds of each page, alternated with its API reads.
const BENCH_ROUNDS: usize = 7;
/// Requests in flight at once, as the console's script allows itself.
const CONSOLE_CONCURRENCY: usize = 4;

/// The console's pages against the plain API reads they are built on: 1,000 endpoints of one
/// tenant, a million stored messages. For each page, rounds alternated: the page loaded afresh
/// in Chromium until every figure it shows is filled in (time from the navigation, by the page's
/// own clock), then the same reads through reqwest with the script's concurrency. Prints the
/// medians and their ratio; asserts nothing about time (BENCHMARKS.md, "Console").
///
/// `cargo test --release --locked -p relay-tests --test it -- --ignored --nocapture console::console_pages`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: run it by name with --ignored"]
async fn console_pages_against_the_api_reads_they_are_built_on() {
    let app = ApiApp::spawn().await;
    let (tenant, token) = app.tenant("console-bench").await;
    let seeded = Instant::now();
    let endpoint = seed_bench(&app.db, tenant).await;
    eprintln!(
        "seeded {BENCH_ENDPOINTS} endpoints and {} messages in {:.0} s",
        BENCH_ENDPOINTS * BENCH_MESSAGES_PER_ENDPOINT,
        seeded.elapsed().as_secs_f64()
    );
    let driver = Driver::start().await;
    let console = Console::new(&driver, &app.base_url).await;
    console.sign_in(&token).await;

    let endpoints_page = (
        "/endpoints".to_owned(),
        "return document.querySelectorAll('[data-testid=\"endpoint-row\"]').length === 50 \
         && !document.querySelector('.pending, [data-testid=\"loading\"]');",
    );
    let endpoint_page = (
        format!("/endpoints/{endpoint}"),
        "return !!document.querySelector('[data-testid=\"state\"]') \
         && document.querySelectorAll('[data-testid=\"message-row\"]').length === 50 \
         && !!document.querySelector('[data-testid=\"copy-table\"], [data-testid=\"copy\"] .empty') \
         && !document.querySelector('.pending, [data-testid=\"loading\"]');",
    );
    let list: Value = app
        .ok(200, "GET", "/v1/endpoints?limit=50", &token, None)
        .await;
    let listed: Vec<String> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| format!("/v1/endpoints/{}/state", e["id"].as_str().unwrap()))
        .collect();
    // Each page, loaded afresh, reads the signed-in tenant first.
    let endpoints_reads: Vec<String> = ["/v1/tenant", "/v1/endpoints?limit=50"]
        .map(str::to_owned)
        .into_iter()
        .chain(listed)
        .collect();
    let e = |suffix: &str| format!("/v1/endpoints/{endpoint}{suffix}");
    let endpoint_reads = vec![
        "/v1/tenant".to_owned(),
        e(""),
        e("/state"),
        e("/activity"),
        e("/secrets"),
        e("/copy?limit=50"),
        e("/messages?limit=50"),
        e("/quarantine?limit=50"),
    ];

    for (name, (route, ready), reads) in [
        ("endpoints", endpoints_page, endpoints_reads),
        ("endpoint", endpoint_page, endpoint_reads),
    ] {
        let (mut page_ms, mut api_ms) = (Vec::new(), Vec::new());
        for _ in 0..BENCH_ROUNDS {
            page_ms.push(page_load_ms(&console, &route, ready).await);
            api_ms.push(api_reads_ms(&app, &token, &reads).await);
        }
        let (page, api) = (median(&mut page_ms), median(&mut api_ms));
        println!(
            "{}",
            json!({"bench": "console", "page": name, "rounds": BENCH_ROUNDS,
                   "api_reads": reads.len(), "page_ms_median": page, "api_ms_median": api,
                   "ratio": page / api, "page_ms": page_ms, "api_ms": api_ms})
        );
    }
    console.browser.close().await.unwrap();
    app.stop().await;
}

/// The benchmark's tenant's endpoints and messages, written in a few statements; one endpoint.
async fn seed_bench(db: &TestDb, tenant: Uuid) -> Uuid {
    sqlx::query(
        "WITH made AS (
             INSERT INTO webhook_endpoints (id, tenant_id)
             SELECT gen_random_uuid(), $1 FROM generate_series(1, $2)
             RETURNING id
         )
         INSERT INTO endpoint_arrival_counters (endpoint_id, last_arrival_seq)
         SELECT id, $3 FROM made",
    )
    .bind(tenant)
    .bind(BENCH_ENDPOINTS)
    .bind(BENCH_MESSAGES_PER_ENDPOINT)
    .execute(&db.pool)
    .await
    .unwrap();
    // A million rows take longer than the test pool's statement timeout allows one statement.
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL statement_timeout = 0")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO messages (endpoint_id, arrival_seq, tenant_id, webhook_id, signed_at,
                               attempt, received_at, track, generation, body, events)
         SELECT e.id, s, e.tenant_id, 'msg_' || md5(e.id::text || s),
                now() - make_interval(secs => 2000 - s), 1,
                now() - make_interval(secs => 2000 - s), 'feed', 1,
                convert_to('{\"v\":1,\"track\":\"feed\",\"generation\":1,\"events\":[]}'
                           || repeat(' ', 150), 'UTF8'), 0
         FROM webhook_endpoints e CROSS JOIN generate_series(1, $2) s
         WHERE e.tenant_id = $1",
    )
    .bind(tenant)
    .bind(BENCH_MESSAGES_PER_ENDPOINT)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::raw_sql("SET LOCAL statement_timeout = 0; ANALYZE")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    sqlx::query_scalar("SELECT id FROM webhook_endpoints WHERE tenant_id = $1 LIMIT 1")
        .bind(tenant)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Loads `route` afresh and waits until `ready` holds: milliseconds from the navigation's start,
/// by the page's clock.
async fn page_load_ms(console: &Console, route: &str, ready: &str) -> f64 {
    console.browser.goto("about:blank").await.unwrap();
    console.open(route).await;
    let check = format!("return (function() {{ {ready} }})() ? performance.now() : null;");
    let started = Instant::now();
    loop {
        let value = console.browser.execute(&check, vec![]).await.unwrap();
        if let Some(ms) = value.as_f64() {
            return ms;
        }
        // A bound for a page that never gets there, not a timing claim.
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{route} never got ready; its text:\n{}",
            console.text().await
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The same reads as a page makes, `CONSOLE_CONCURRENCY` at a time: milliseconds for all.
async fn api_reads_ms(app: &ApiApp, token: &str, reads: &[String]) -> f64 {
    use futures::StreamExt as _;
    let started = Instant::now();
    let statuses: Vec<u16> = futures::stream::iter(reads.iter().map(|path| async move {
        app.client
            .get(format!("{}{path}", app.base_url))
            .bearer_auth(token)
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .map(|_| 200u16)
            .unwrap()
    }))
    .buffer_unordered(CONSOLE_CONCURRENCY)
    .collect()
    .await;
    assert_eq!(statuses.len(), reads.len());
    started.elapsed().as_secs_f64() * 1000.0
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// A stories endpoint of `tenant` (registered through the API) holding one story whose headline
/// carries markup, claimed strong and notified, written as the sequencer writes them; its id.
async fn stories_endpoint_with_a_hostile_story(app: &ApiApp, tenant: Uuid, token: &str) -> Uuid {
    use relay_rules::{plan_writes, PlannedClaim, StoryWrite};
    use relay_store::stories::{self as store, PlanCause};

    let endpoint = Uuid::new_v4();
    app.ok(
        201,
        "POST",
        "/v1/endpoints",
        token,
        Some(
            &json!({"id": endpoint, "source": "stories", "stories_mode": "snapshot",
                     "tickers": ["ALFA B"],
                     "secrets": [relay_tests::random_secret().to_whsec()]}),
        ),
    )
    .await;
    let (tenant, id) = (
        relay_store::TenantId(tenant),
        relay_store::EndpointId(endpoint),
    );
    store::sync_state(&app.db.pool, tenant, id).await.unwrap();
    let fence = app.db.claim_fence(endpoint).await;
    let story = relay_wire::Story::from_value(&json!({
        "id": "st_666", "ticker": "ALFA B", "version": 1, "headline": HOSTILE_TITLE}))
    .unwrap();
    let mut writer = store::open(&app.db.pool, tenant, id, fence)
        .await
        .unwrap()
        .expect("the fence is ours");
    let held = writer.held(&["st_666".to_owned()]).await.unwrap();
    let mut plan = plan_writes(&held, [StoryWrite::Save(story.clone())]);
    plan.writes[0].event_id = Some("ev_created_666".into());
    plan.claims = vec![PlannedClaim {
        key: "strong:st_666".into(),
        story,
        event_id: "ev_strong_666".into(),
        notify: true,
    }];
    writer.write_plan(&plan, PlanCause::Events).await.unwrap();
    writer.commit().await.unwrap();
    endpoint
}
