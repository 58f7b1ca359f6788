//! RULES.md names, for every rule, the function that decides it, the statement that carries it
//! out and the tests that show it. Those names drift when code moves; this test reads the file
//! and fails on every name that no longer exists where the file says it is:
//!
//! - each test of a row's Tests column must be a `fn` of the file its group names (`rules.rs`,
//!   `src/x.rs`, `it/x.rs`, `wire_vector.rs`, `wire src/x.rs`, ...);
//! - each path (`store::copy::merge`, `relay_wire::Message::parse`, `sequencer::reload`) anywhere
//!   in the file must resolve: its modules to files, then its last names to items of them;
//! - each file named (`services/ingest/src/handler.rs`, a migration) must exist;
//! - each bare name in a Decided-by cell must be a function or a field of relay-rules (or of
//!   the crate the cell names), and in a Carried-out cell an item of some service or a table or
//!   column of the migrations;
//! - each rule's id must be cited (`Rules: R-ORDER, ...`) at the code that decides it: in some
//!   source file of `services/`.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// The workspace's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `.rs` file under `dir`, with its text.
fn sources(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut found = Vec::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n == "target") {
                continue;
            }
            found.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            if let Ok(text) = fs::read_to_string(&path) {
                found.push((path, text));
            }
        }
    }
    found
}

/// The backticked spans of `text`.
fn spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

fn is_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Whether `text` holds `word` as a whole word.
fn has_word(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        !before.is_some_and(is_word) && !after.is_some_and(is_word)
    })
}

/// Whether `text` declares `name`: a function, a module, a field, a constant or static, a type,
/// or (for a CamelCase name) any use of it as a word (an enum variant).
fn declares(text: &str, name: &str) -> bool {
    let starts_upper = name.chars().next().is_some_and(|c| c.is_ascii_uppercase());
    if starts_upper {
        return has_word(text, name);
    }
    [
        format!("fn {name}("),
        format!("fn {name}<"),
        format!("mod {name}"),
        format!("{name}:"),
        format!("static {name}"),
        format!("let {name}"),
    ]
    .iter()
    .any(|form| text.contains(form.as_str()))
}

fn is_identifier(text: &str) -> bool {
    !text.is_empty() && text.chars().all(is_word) && !text.starts_with(|c: char| c.is_ascii_digit())
}

/// Where a path's first segment lives.
fn crate_dir(first: &str) -> Option<&'static str> {
    Some(match first {
        "store" | "relay_store" => "services/store/src",
        "sequencer" | "relay_sequencer" => "services/sequencer/src",
        "ingest" | "relay_ingest" => "services/ingest/src",
        "relay_wire" | "wire" => "services/wire/src",
        "relay_rules" => "services/rules/src",
        "relay" => "services/relay/src",
        "api" | "relay_api" => "services/api/src",
        "publisher" | "relay_publisher" => "services/publisher/src",
        "coord" | "relay_coord" => "services/coord/src",
        _ => return None,
    })
}

struct Checker {
    root: PathBuf,
    /// Every source file of `services/`.
    services: Vec<(PathBuf, String)>,
    migrations: String,
    problems: BTreeSet<String>,
}

impl Checker {
    fn new() -> Self {
        let root = root();
        let services = sources(&root.join("services"));
        let mut migrations = String::new();
        for entry in fs::read_dir(root.join("migrations")).unwrap().flatten() {
            migrations.push_str(&fs::read_to_string(entry.path()).unwrap_or_default());
        }
        Self {
            root,
            services,
            migrations,
            problems: BTreeSet::new(),
        }
    }

    fn texts_under<'a>(&'a self, dir: &'a Path) -> impl Iterator<Item = &'a str> + 'a {
        self.services
            .iter()
            .filter(move |(path, _)| path.starts_with(dir))
            .map(|(_, text)| text.as_str())
    }

    /// `name` is declared in `file`, or anywhere under `dir`.
    fn declared(&self, name: &str, file: Option<&Path>, dir: &Path) -> bool {
        match file {
            Some(file) => fs::read_to_string(file).is_ok_and(|text| declares(&text, name)),
            None => self.texts_under(dir).any(|text| declares(text, name)),
        }
    }

    /// A `a::b::c` path: modules as files from the crate's directory, then the rest as items.
    fn check_path(&mut self, path: &str, context: &str) {
        let segments: Vec<&str> = path.split("::").collect();
        if !segments.iter().all(|s| is_identifier(s)) {
            return;
        }
        let (dir, rest) = match crate_dir(segments[0]) {
            Some(dir) => (self.root.join(dir), &segments[1..]),
            // A type's member (`MergePlan::ReadAgain`): somewhere in the services.
            None => (self.root.join("services"), &segments[..]),
        };
        let mut dir = dir;
        let mut file: Option<PathBuf> = None;
        for (i, segment) in rest.iter().enumerate() {
            let as_file = dir.join(format!("{segment}.rs"));
            let as_dir = dir.join(segment);
            if file.is_none() && (as_file.is_file() || as_dir.join("mod.rs").is_file()) {
                file = Some(if as_file.is_file() {
                    as_file
                } else {
                    as_dir.join("mod.rs")
                });
                dir = as_dir;
                continue;
            }
            // A method or variant of a type named before it may be declared in another file.
            let scope_file = if i > 0 && rest[i - 1].starts_with(|c: char| c.is_uppercase()) {
                None
            } else {
                file.as_deref()
            };
            let scope_dir = if file.is_some() && scope_file.is_none() {
                dir.parent()
                    .map(Path::to_path_buf)
                    .unwrap_or_else(|| dir.clone())
            } else {
                dir.clone()
            };
            if !self.declared(segment, scope_file, &scope_dir) {
                self.problems
                    .insert(format!("{context}: `{path}`: no `{segment}` where it says"));
                return;
            }
        }
    }

    fn check_file(&mut self, name: &str, context: &str) {
        let exists = if name.ends_with(".sql") && !name.contains('/') {
            self.root.join("migrations").join(name).is_file()
        } else {
            self.root.join(name).is_file() || self.root.join("services").join(name).is_file()
        };
        if !exists {
            self.problems
                .insert(format!("{context}: the file `{name}` does not exist"));
        }
    }

    /// A bare name of a Decided-by cell: an item of relay-rules, or of the crate the cell is
    /// about (the ingest tier's, the sequencer's).
    fn check_decided(&mut self, name: &str, cell: &str, context: &str) {
        let mut dirs = vec!["services/rules/src", "services/wire/src"];
        for (crate_name, dir) in [
            ("ingest", "services/ingest/src"),
            ("sequencer", "services/sequencer/src"),
            ("store", "services/store/src"),
        ] {
            if cell.contains(crate_name) {
                dirs.push(dir);
            }
        }
        let found = dirs
            .iter()
            .any(|dir| self.declared(name, None, &self.root.join(dir)));
        if !found {
            self.problems.insert(format!(
                "{context}: decided by `{name}`, which relay-rules does not declare"
            ));
        }
    }

    /// A bare name of a Carried-out cell: an item of a service, a metric it registers, or a table
    /// or column.
    fn check_carried(&mut self, name: &str, context: &str) {
        let services = self.root.join("services");
        let quoted = format!("\"{name}\"");
        if self.declared(name, None, &services)
            || self
                .texts_under(&services)
                .any(|text| text.contains(&quoted))
            || has_word(&self.migrations, name)
        {
            return;
        }
        self.problems.insert(format!(
            "{context}: carried out by `{name}`, which no service or migration declares"
        ));
    }

    /// The Tests cell: groups `file: \`a\`, \`b\`` separated by `;`.
    fn check_tests(&mut self, cell: &str, context: &str) {
        for group in cell.split("; ") {
            let Some((head, names)) = group.split_once(':') else {
                continue;
            };
            let Some(file) = spans(head).first().copied() else {
                continue;
            };
            // A group whose names are prose (`it/restore.rs`: each answer after a real
            // `pg_dump`) names no function.
            if !names.trim_start().starts_with('`') {
                continue;
            }
            let path = if let Some(rest) = file.strip_prefix("wire src/") {
                format!("services/wire/src/{rest}")
            } else if let Some(rest) = file.strip_prefix("simulator src/") {
                format!("services/simulator/src/{rest}")
            } else if let Some(rest) = file.strip_prefix("src/") {
                format!("services/rules/src/{rest}")
            } else if let Some(rest) = file.strip_prefix("it/") {
                format!("tests/it/{rest}")
            } else if file == "wire_vector.rs" {
                "services/wire/tests/wire_vector.rs".to_owned()
            } else {
                format!("services/rules/tests/{file}")
            };
            let Ok(text) = fs::read_to_string(self.root.join(&path)) else {
                self.problems.insert(format!(
                    "{context}: the test file `{file}` ({path}) does not exist"
                ));
                continue;
            };
            for name in spans(names).into_iter().filter(|n| is_identifier(n)) {
                if !text.contains(&format!("fn {name}(")) {
                    self.problems
                        .insert(format!("{context}: no test `{name}` in `{file}`"));
                }
            }
        }
    }
}

/// The rule ids a `/// Rules: R-ORDER, R-DEDUP (...)` line cites.
fn cites(line: &str) -> impl Iterator<Item = &str> {
    line.split_once("Rules: ")
        .map_or("", |(_, rest)| rest)
        .split([',', ' ', '('])
        .filter(|token| token.starts_with("R-") || token.starts_with("S-"))
}

#[test]
fn every_function_test_and_statement_rules_md_names_exists_where_it_says() {
    let text = fs::read_to_string(root().join("services/rules/RULES.md")).unwrap();
    let mut checker = Checker::new();
    for (number, line) in text.lines().enumerate() {
        let context = format!("RULES.md:{}", number + 1);
        for span in spans(line) {
            if span.contains("::") && !span.contains(' ') {
                let path = span.trim_end_matches("()");
                checker.check_path(path, &context);
            } else if (span.ends_with(".rs") || span.ends_with(".sql"))
                && !span.contains(' ')
                && span.contains(['/', '_'])
                && (span.starts_with("services/")
                    || span.contains("/src/")
                    || span.ends_with(".sql"))
                // The columns' legend: `src/x.rs` stands for any file.
                && !span.ends_with("/x.rs")
            {
                checker.check_file(span, &context);
            }
        }
        if !line.starts_with("| <a id=") {
            continue;
        }
        let cells: Vec<&str> = line.trim_matches('|').split(" | ").collect();
        let [_, _, decided, carried, tests] = cells[..] else {
            panic!("{context}: a row of five cells: {line}");
        };
        for name in spans(decided).into_iter().filter(|n| is_identifier(n)) {
            checker.check_decided(name, decided, &context);
        }
        for name in spans(carried).into_iter().filter(|n| is_identifier(n)) {
            checker.check_carried(name, &context);
        }
        checker.check_tests(tests, &context);
    }
    for line in text.lines().filter(|line| line.starts_with("| <a id=")) {
        let id = line
            .split("</a>")
            .nth(1)
            .and_then(|rest| rest.split(" | ").next())
            .unwrap_or_default()
            .trim();
        let cited = checker
            .services
            .iter()
            .any(|(_, source)| source.lines().any(|l| cites(l).any(|cited| cited == id)));
        if !cited {
            checker
                .problems
                .insert(format!("{id}: cited at no code (`/// Rules: {id}, ...`)"));
        }
    }
    assert!(
        checker.problems.is_empty(),
        "RULES.md names what is not there:\n{}",
        checker.problems.into_iter().collect::<Vec<_>>().join("\n")
    );
}
