//! The web console: a page, its style and its script (native ES modules, no build step),
//! compiled into the binary and served by the control plane at `/console/`, so a relay built
//! from source needs nothing else to show it.
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
//! string as text (`textContent`, text nodes), never as markup, inside an isolating element
//! with its bidirectional control characters made visible.

use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

/// Where the console is served.
const CONSOLE_PATH: &str = "/console/";

const HTML: &str = "text/html; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

/// Every file of the console: its path, its content type and its text. A module the script
/// imports must be here (the tests below check every import resolves to a path of this table,
/// and that every file in `console/` is in it).
const FILES: &[(&str, &str, &str)] = &[
    (CONSOLE_PATH, HTML, include_str!("../console/index.html")),
    ("/console/app.css", CSS, include_str!("../console/app.css")),
    ("/console/app.js", JS, include_str!("../console/app.js")),
    (
        "/console/lib/api.js",
        JS,
        include_str!("../console/lib/api.js"),
    ),
    (
        "/console/lib/chart.js",
        JS,
        include_str!("../console/lib/chart.js"),
    ),
    (
        "/console/lib/dom.js",
        JS,
        include_str!("../console/lib/dom.js"),
    ),
    (
        "/console/lib/format.js",
        JS,
        include_str!("../console/lib/format.js"),
    ),
    (
        "/console/lib/session.js",
        JS,
        include_str!("../console/lib/session.js"),
    ),
    (
        "/console/lib/widgets.js",
        JS,
        include_str!("../console/lib/widgets.js"),
    ),
    (
        "/console/views/broker.js",
        JS,
        include_str!("../console/views/broker.js"),
    ),
    (
        "/console/views/endpoint.js",
        JS,
        include_str!("../console/views/endpoint.js"),
    ),
    (
        "/console/views/endpoint/activity.js",
        JS,
        include_str!("../console/views/endpoint/activity.js"),
    ),
    (
        "/console/views/endpoint/copy.js",
        JS,
        include_str!("../console/views/endpoint/copy.js"),
    ),
    (
        "/console/views/endpoint/messages.js",
        JS,
        include_str!("../console/views/endpoint/messages.js"),
    ),
    (
        "/console/views/endpoint/overview.js",
        JS,
        include_str!("../console/views/endpoint/overview.js"),
    ),
    (
        "/console/views/endpoint/quarantine.js",
        JS,
        include_str!("../console/views/endpoint/quarantine.js"),
    ),
    (
        "/console/views/endpoint/stories.js",
        JS,
        include_str!("../console/views/endpoint/stories.js"),
    ),
    (
        "/console/views/endpoint/stream.js",
        JS,
        include_str!("../console/views/endpoint/stream.js"),
    ),
    (
        "/console/views/endpoints.js",
        JS,
        include_str!("../console/views/endpoints.js"),
    ),
    (
        "/console/views/message.js",
        JS,
        include_str!("../console/views/message.js"),
    ),
    (
        "/console/views/signin.js",
        JS,
        include_str!("../console/views/signin.js"),
    ),
    (
        "/console/views/tenants.js",
        JS,
        include_str!("../console/views/tenants.js"),
    ),
];

/// Same origin only, nothing inline, no framing, no form posted anywhere.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// The console's routes, for any state: its files need none.
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    let router = Router::new().route(
        "/console",
        get(|| async { Redirect::permanent(CONSOLE_PATH) }),
    );
    FILES
        .iter()
        .fold(router, |router, &(path, content_type, body)| {
            router.route(path, get(move || async move { asset(content_type, body) }))
        })
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn served() -> BTreeSet<&'static str> {
        FILES.iter().map(|&(path, _, _)| path).collect()
    }

    /// The module specifiers a script names: `import ... from '...'`, `import '...'`,
    /// `export ... from '...'` and `import('...')`.
    fn specifiers(source: &str) -> Vec<String> {
        // Comments go first (a statement may follow them): whole-line ones and trailing ones.
        let code: String = source
            .lines()
            .filter(|line| !line.trim_start().starts_with("//"))
            .map(|line| line.split(" // ").next().unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n");
        let mut found = Vec::new();
        for statement in code.split(';') {
            let s = statement.trim_start();
            let static_form = (s.starts_with("import") || s.starts_with("export"))
                && (s.contains(" from ")
                    || s.starts_with("import '")
                    || s.starts_with("import \""));
            let mut rest = statement;
            while let Some(at) = rest.find("import(") {
                let tail = &rest[at + "import(".len()..];
                if let Some(spec) = quoted(tail.trim_start()) {
                    found.push(spec);
                }
                rest = tail;
            }
            if !static_form {
                continue;
            }
            let tail = match s.rfind(" from ") {
                Some(at) => &s[at + " from ".len()..],
                None => &s["import".len()..],
            };
            if let Some(spec) = quoted(tail.trim_start()) {
                found.push(spec);
            }
        }
        found
    }

    fn quoted(text: &str) -> Option<String> {
        let quote = text.chars().next().filter(|c| *c == '\'' || *c == '"')?;
        let end = text[1..].find(quote)?;
        Some(text[1..1 + end].to_owned())
    }

    /// `spec` as the browser resolves it against the module at `base` (a path).
    fn resolve(base: &str, spec: &str) -> String {
        let mut parts: Vec<&str> = if spec.starts_with('/') {
            Vec::new()
        } else {
            let dir = &base[..=base.rfind('/').unwrap()];
            dir.split('/').filter(|p| !p.is_empty()).collect()
        };
        for piece in spec.split('/').filter(|p| !p.is_empty()) {
            match piece {
                "." => {}
                ".." => {
                    parts.pop();
                }
                other => parts.push(other),
            }
        }
        format!("/{}", parts.join("/"))
    }

    #[test]
    fn every_import_of_every_module_resolves_to_a_served_file() {
        let served = served();
        let mut imports = 0;
        for &(path, content_type, body) in FILES {
            if content_type != JS {
                continue;
            }
            for spec in specifiers(body) {
                assert!(
                    spec.starts_with("./") || spec.starts_with("../") || spec.starts_with('/'),
                    "{path} imports {spec:?}: only paths of this origin are served"
                );
                let target = resolve(path, &spec);
                assert!(
                    served.contains(target.as_str()),
                    "{path} imports {spec:?} ({target}), which the console does not serve: add it \
                     to FILES"
                );
                imports += 1;
            }
        }
        assert!(imports > 20, "the modules import one another: {imports}");
    }

    #[test]
    fn the_page_loads_the_script_as_a_module_and_its_style_from_served_paths() {
        let index = FILES[0].2;
        assert!(
            index.contains(r#"<script type="module" src="/console/app.js"></script>"#),
            "{index}"
        );
        assert!(index.contains(r#"href="/console/app.css""#));
        assert!(!index.contains("<style") && !index.contains(" style="));
    }

    #[test]
    fn every_file_in_the_console_folder_is_served_and_every_served_file_exists() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("console");
        let mut on_disk = BTreeSet::new();
        let mut folders = vec![root.clone()];
        while let Some(folder) = folders.pop() {
            for entry in std::fs::read_dir(&folder).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    folders.push(path);
                } else {
                    let relative = path.strip_prefix(&root).unwrap().to_str().unwrap();
                    on_disk.insert(format!("/console/{}", relative.replace('\\', "/")));
                }
            }
        }
        let served: BTreeSet<String> = served()
            .into_iter()
            .map(|p| {
                if p == CONSOLE_PATH {
                    "/console/index.html".to_owned()
                } else {
                    p.to_owned()
                }
            })
            .collect();
        assert_eq!(on_disk, served, "console/ and FILES differ");
    }

    #[test]
    fn no_module_parses_markup_or_evaluates_text() {
        for &(path, content_type, body) in FILES {
            if content_type != JS {
                continue;
            }
            // The code, not the comments that name what it never does.
            let code: String = body
                .lines()
                .filter(|line| !line.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            for refused in [
                "innerHTML",
                "outerHTML",
                "insertAdjacentHTML",
                "document.write",
                "eval(",
                "new Function",
                "createContextualFragment",
                "DOMParser",
                "localStorage",
                ".style.",
            ] {
                assert!(!code.contains(refused), "{path} uses {refused}");
            }
        }
    }

    #[test]
    fn imports_are_found_and_resolved_as_a_browser_does() {
        let source = "// A module.\nimport { a } from './lib/a.js'; // the first\nimport {\n  b,\n  c,\n} from '../b.js';\n\
                      import './side.js';\nexport { d } from \"/console/d.js\";\n\
                      const e = await import('./e.js');\nconst f = 'import x from y';";
        assert_eq!(
            specifiers(source),
            [
                "./lib/a.js",
                "../b.js",
                "./side.js",
                "/console/d.js",
                "./e.js"
            ]
        );
        assert_eq!(
            resolve("/console/views/endpoint/copy.js", "../../lib/dom.js"),
            "/console/lib/dom.js"
        );
        assert_eq!(
            resolve("/console/app.js", "./views/tenants.js"),
            "/console/views/tenants.js"
        );
    }
}
