//! The web console: a page and its script and style, compiled into the binary and served by the
//! control plane at `/console/`, so a relay built from source needs nothing else to show it.
//!
//! The console is a client of the API like any other: it holds the token the user pastes for
//! the browser session only (`sessionStorage`) and sends it in the `Authorization` header, so
//! it reaches exactly what the token reaches. No cookie carries authority, so a form another
//! site makes the browser post changes nothing: it cannot set the header, and the API sends no
//! CORS headers to let a script of another origin read or send with one.
//!
//! Every answer here carries a Content Security Policy that allows script, style and requests
//! from this origin only, and no inline script or style: a string a tenant or the upstream
//! controls that reached the page as markup could still not run. The script renders every such
//! string as text (`textContent`), never as markup.

use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

/// Where the console is served.
const CONSOLE_PATH: &str = "/console/";

const INDEX_HTML: &str = include_str!("../console/index.html");
const APP_JS: &str = include_str!("../console/app.js");
const APP_CSS: &str = include_str!("../console/app.css");

/// Same origin only, nothing inline, no framing, no form posted anywhere.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// The console's routes, for any state: its files need none.
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/console",
            get(|| async { Redirect::permanent(CONSOLE_PATH) }),
        )
        .route(
            CONSOLE_PATH,
            get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }),
        )
        .route(
            "/console/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route(
            "/console/app.css",
            get(|| async { asset("text/css; charset=utf-8", APP_CSS) }),
        )
}

/// One of the console's files with the headers every one of them carries.
fn asset(content_type: &'static str, body: &'static str) -> Response {
    let headers = [
        (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        ),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
        (header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")),
        (
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ),
        (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        (
            HeaderName::from_static("cross-origin-opener-policy"),
            HeaderValue::from_static("same-origin"),
        ),
        (
            HeaderName::from_static("cross-origin-resource-policy"),
            HeaderValue::from_static("same-origin"),
        ),
    ];
    (StatusCode::OK, headers, body).into_response()
}
