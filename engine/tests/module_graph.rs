//! The engine's rooms import each other without a cycle, and `raw/` (the lock-free storage)
//! imports nothing from `index/`.
//!
//! The test reads `engine/src/**/*.rs` and builds the graph of references between the crate's
//! top-level modules: every `crate::…` path (in `use` declarations, grouped or not, and
//! inline), every `super::…` path that climbs out of its top-level module, and every
//! `crate::Name` that the crate root re-exports (resolved to the module the name comes from).
//! Comments, string and character literals are ignored, and so is test-only code: any item,
//! statement or module under `#[cfg(test)]` or `#[cfg(all(test, …))]`. Modules must live where
//! their files are (no `#[path]`). The crate root (`lib.rs`) is the crate's face, not a room:
//! it declares and re-exports every module, so its own references are not edges. A `crate::`
//! path that names neither a module nor a re-exported item fails the test (it would otherwise
//! be an edge the graph silently misses).

use std::collections::{BTreeMap, BTreeSet};
mod common;

use common::source_text::{code_only, rust_files};
use std::path::Path;

/// One reference from a top-level module to another, with where it was first seen.
#[derive(Debug, Clone)]
struct Edge {
    to: String,
    file: String,
    line: usize,
}

/// The module graph: top-level module → the modules it references (first sighting each).
type Graph = BTreeMap<String, BTreeMap<String, Edge>>;

/// A source file: its module path inside the crate (`["index", "walk"]`) and its text.
struct Source {
    module: Vec<String>,
    file: String,
    text: String,
}

fn module_path_of(relative: &Path) -> Vec<String> {
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

fn read_sources(root: &Path) -> Vec<Source> {
    let mut files = Vec::new();
    rust_files(root, &mut files);
    files
        .into_iter()
        .map(|path| {
            let relative = path.strip_prefix(root).expect("under the source root");
            Source {
                module: module_path_of(relative),
                file: relative.display().to_string(),
                text: std::fs::read_to_string(&path)
                    .unwrap_or_else(|e| panic!("reading {}: {e}", path.display())),
            }
        })
        .collect()
}

/// Whether a `#[cfg(…)]` attribute's predicate makes its item test-only.
fn is_test_only(predicate: &str) -> bool {
    let p: String = predicate.chars().filter(|c| !c.is_whitespace()).collect();
    p == "test" || p.starts_with("all(test,") || p == "all(test)"
}

/// The code with every test-only item blanked out (newlines kept). Returns `None` when the
/// whole file is test-only (`#![cfg(test)]`).
fn without_test_code(code: &str) -> Option<String> {
    let chars: Vec<char> = code.chars().collect();
    let mut keep = vec![true; chars.len()];
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '#' {
            i += 1;
            continue;
        }
        let start = i;
        let mut j = i + 1;
        let inner = chars.get(j) == Some(&'!');
        if inner {
            j += 1;
        }
        if chars.get(j) != Some(&'[') {
            i += 1;
            continue;
        }
        // The attribute's body, up to its matching `]`.
        let mut depth = 0;
        let body_start = j + 1;
        while j < chars.len() {
            match chars[j] {
                '[' => depth += 1,
                ']' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                _ => {}
            }
            j += 1;
        }
        let body: String = chars[body_start..j.min(chars.len())].iter().collect();
        let body = body.trim();
        let test_only = body
            .strip_prefix("cfg")
            .map(str::trim_start)
            .and_then(|b| b.strip_prefix('('))
            .and_then(|b| b.strip_suffix(')'))
            .is_some_and(is_test_only);
        if !test_only {
            i = j + 1;
            continue;
        }
        if inner {
            return None;
        }
        // The item: up to the first `;` or the end of the first `{…}` block at depth 0
        // (other attributes, a signature's parentheses and generics come before either).
        let mut k = j + 1;
        let mut parens = 0i32;
        while k < chars.len() {
            match chars[k] {
                '(' | '[' => parens += 1,
                ')' | ']' => parens -= 1,
                ';' if parens == 0 => break,
                '{' if parens == 0 => {
                    let mut braces = 0;
                    while k < chars.len() {
                        match chars[k] {
                            '{' => braces += 1,
                            '}' => {
                                braces -= 1;
                                if braces == 0 {
                                    break;
                                }
                            }
                            _ => {}
                        }
                        k += 1;
                    }
                    break;
                }
                _ => {}
            }
            k += 1;
        }
        for flag in keep.iter_mut().take((k + 1).min(chars.len())).skip(start) {
            *flag = false;
        }
        i = k + 1;
    }
    Some(
        chars
            .iter()
            .zip(&keep)
            .map(|(&c, &k)| if k || c == '\n' { c } else { ' ' })
            .collect(),
    )
}

/// Files a test-only `mod name;` declaration pulls in: their module paths.
fn test_only_modules(sources: &[Source]) -> BTreeSet<Vec<String>> {
    let mut out = BTreeSet::new();
    for s in sources {
        let code = code_only(&s.text);
        let kept = without_test_code(&code).unwrap_or_default();
        // A `mod name;` present in the code but blanked in the kept text is test-only.
        for (line, kept_line) in code.lines().zip(kept.lines()) {
            let trimmed = line.trim();
            let declared = trimmed
                .trim_start_matches("pub(crate) ")
                .trim_start_matches("pub(super) ")
                .trim_start_matches("pub ")
                .strip_prefix("mod ")
                .and_then(|rest| rest.strip_suffix(';'));
            if let Some(name) = declared
                && kept_line.trim().is_empty()
            {
                let mut module = s.module.clone();
                module.push(name.trim().to_string());
                out.insert(module);
            }
        }
    }
    out
}

/// Identifier at `chars[i..]`, if any.
fn ident_at(chars: &[char], i: usize) -> Option<(String, usize)> {
    let is_start = |c: char| c.is_alphabetic() || c == '_';
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    if !chars.get(i).copied().is_some_and(is_start) {
        return None;
    }
    let mut j = i;
    while j < chars.len() && is_ident(chars[j]) {
        j += 1;
    }
    Some((chars[i..j].iter().collect(), j))
}

fn skip_space(chars: &[char], mut i: usize) -> usize {
    while i < chars.len() && chars[i].is_whitespace() {
        i += 1;
    }
    i
}

/// `::` at `i` (after spaces): the index after it.
fn path_sep(chars: &[char], i: usize) -> Option<usize> {
    let i = skip_space(chars, i);
    (chars.get(i) == Some(&':') && chars.get(i + 1) == Some(&':')).then_some(i + 2)
}

/// The first segments named right after a path prefix ending at `i` (`a`, or each element's
/// first segment of a `{a::x, b}` group).
fn first_segments(chars: &[char], i: usize) -> Vec<String> {
    let i = skip_space(chars, i);
    if chars.get(i) == Some(&'{') {
        let mut out = Vec::new();
        let mut j = i + 1;
        let mut depth = 1;
        let mut at_element = true;
        while j < chars.len() && depth > 0 {
            let c = chars[j];
            if c == '{' {
                depth += 1;
            } else if c == '}' {
                depth -= 1;
            } else if c == ',' && depth == 1 {
                at_element = true;
            } else if !c.is_whitespace() && at_element && depth == 1 {
                if let Some((name, end)) = ident_at(chars, j) {
                    out.push(name);
                    j = end;
                    at_element = false;
                    continue;
                }
                at_element = false;
            }
            j += 1;
        }
        out
    } else {
        ident_at(chars, i).map(|(n, _)| vec![n]).unwrap_or_default()
    }
}

/// Items the crate root re-exports: name → the top-level module it comes from.
fn root_reexports(sources: &[Source]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Some(lib) = sources.iter().find(|s| s.module.is_empty()) else {
        return out;
    };
    let code = code_only(&lib.text);
    let chars: Vec<char> = code.chars().collect();
    let text: String = chars.iter().collect();
    for (pos, _) in text.match_indices("pub use ") {
        let start = text[..pos].chars().count() + "pub use ".len();
        let Some((module, end)) = ident_at(&chars, start) else {
            continue;
        };
        let Some(after) = path_sep(&chars, end) else {
            continue;
        };
        let after = skip_space(&chars, after);
        if chars.get(after) == Some(&'*') {
            // A glob: every public item the module's own files declare at their top level.
            for s in sources.iter().filter(|s| s.module.first() == Some(&module)) {
                for line in code_only(&s.text).lines() {
                    let words: Vec<&str> = line.split_whitespace().collect();
                    if words.len() >= 3
                        && words[0] == "pub"
                        && [
                            "struct", "enum", "fn", "const", "type", "trait", "mod", "static",
                        ]
                        .contains(&words[1])
                    {
                        let name: String = words[2]
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        out.insert(name, module.clone());
                    }
                }
            }
        } else {
            for name in first_segments(&chars, after) {
                out.insert(name, module.clone());
            }
        }
    }
    out
}

/// Builds the graph of references between top-level modules.
fn build_graph(sources: &[Source]) -> Result<Graph, Vec<String>> {
    let top_level: BTreeSet<String> = sources
        .iter()
        .filter_map(|s| s.module.first().cloned())
        .collect();
    let reexports = root_reexports(sources);
    let test_only = test_only_modules(sources);
    let mut graph: Graph = top_level
        .iter()
        .map(|m| (m.clone(), BTreeMap::new()))
        .collect();
    let mut unresolved = Vec::new();
    for s in sources {
        let Some(from) = s.module.first() else {
            continue; // the crate root
        };
        if test_only
            .iter()
            .any(|t| s.module.len() >= t.len() && s.module[..t.len()] == t[..])
        {
            continue;
        }
        let Some(code) = without_test_code(&code_only(&s.text)) else {
            continue;
        };
        let chars: Vec<char> = code.chars().collect();
        let mut i = 0;
        while i < chars.len() {
            let boundary = i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
            let Some((word, end)) = boundary.then(|| ident_at(&chars, i)).flatten() else {
                i += 1;
                continue;
            };
            // The module path a `crate::` or `super::…::` prefix lands in, and where the
            // names after it start.
            let landing = match word.as_str() {
                "crate" => path_sep(&chars, end).map(|after| (Vec::new(), after)),
                "super" => {
                    let mut module = s.module.clone();
                    let mut after = end;
                    let mut ok = true;
                    loop {
                        if module.pop().is_none() {
                            ok = false;
                        }
                        let Some(next) = path_sep(&chars, after) else {
                            ok = false;
                            break;
                        };
                        after = next;
                        match ident_at(&chars, skip_space(&chars, after)) {
                            Some((w, e)) if w == "super" => after = e,
                            _ => break,
                        }
                    }
                    ok.then_some((module, after))
                }
                _ => None,
            };
            i = end;
            let Some((module, after)) = landing else {
                continue;
            };
            if !module.is_empty() {
                continue; // still inside a top-level module: not an edge
            }
            let line = chars[..after].iter().filter(|&&c| c == '\n').count() + 1;
            for name in first_segments(&chars, after) {
                let to = if top_level.contains(&name) {
                    name.clone()
                } else if let Some(m) = reexports.get(&name) {
                    m.clone()
                } else if name == "self" {
                    continue;
                } else {
                    unresolved.push(format!("{}:{line}: crate::{name}", s.file));
                    continue;
                };
                if &to != from {
                    graph
                        .get_mut(from)
                        .expect("every top-level module is a node")
                        .entry(to.clone())
                        .or_insert(Edge {
                            to,
                            file: s.file.clone(),
                            line,
                        });
                }
            }
        }
    }
    if unresolved.is_empty() {
        Ok(graph)
    } else {
        Err(unresolved)
    }
}

/// The first cycle a depth-first search meets, as the list of its edges.
fn find_cycle(graph: &Graph) -> Option<Vec<Edge>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    fn visit(
        node: &str,
        graph: &Graph,
        marks: &mut BTreeMap<String, Mark>,
        stack: &mut Vec<(String, Edge)>,
    ) -> Option<Vec<Edge>> {
        marks.insert(node.to_string(), Mark::Open);
        for edge in graph.get(node).map(|e| e.values()).into_iter().flatten() {
            match marks.get(&edge.to).copied().unwrap_or(Mark::New) {
                Mark::Open => {
                    let start = stack
                        .iter()
                        .position(|(from, _)| *from == edge.to)
                        .unwrap_or(stack.len());
                    let mut cycle: Vec<Edge> =
                        stack[start..].iter().map(|(_, e)| e.clone()).collect();
                    cycle.push(edge.clone());
                    return Some(cycle);
                }
                Mark::New => {
                    stack.push((node.to_string(), edge.clone()));
                    if let Some(c) = visit(&edge.to, graph, marks, stack) {
                        return Some(c);
                    }
                    stack.pop();
                }
                Mark::Done => {}
            }
        }
        marks.insert(node.to_string(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for node in graph.keys() {
        if marks.get(node).copied().unwrap_or(Mark::New) == Mark::New {
            let mut stack = Vec::new();
            if let Some(c) = visit(node, graph, &mut marks, &mut stack) {
                return Some(c);
            }
        }
    }
    None
}

fn describe(cycle: &[Edge], start: &str) -> String {
    let mut s = start.to_string();
    for e in cycle {
        s.push_str(&format!(" -> {} ({}:{})", e.to, e.file, e.line));
    }
    s
}

/// The violations of the engine's module rules: a cycle, and any reference from `raw` to
/// `index`.
fn violations(sources: &[Source]) -> Vec<String> {
    let mut out = Vec::new();
    // A `#[path]` module lives where its file does not say: the graph would misplace it.
    for s in sources {
        for (n, line) in code_only(&s.text).lines().enumerate() {
            if line.trim_start().starts_with("#[path") {
                out.push(format!(
                    "{}:{}: a #[path] module (keep files where their modules are)",
                    s.file,
                    n + 1
                ));
            }
        }
    }
    let graph = match build_graph(sources) {
        Ok(g) => g,
        Err(unresolved) => {
            out.extend(
                unresolved
                    .into_iter()
                    .map(|u| format!("unresolved crate path {u}")),
            );
            return out;
        }
    };
    if let Some(cycle) = find_cycle(&graph) {
        // The cycle starts where its last edge ends.
        let start = cycle.last().map(|e| e.to.clone()).unwrap_or_default();
        out.push(format!("import cycle: {}", describe(&cycle, &start)));
    }
    if let Some(e) = graph.get("raw").and_then(|edges| edges.get("index")) {
        out.push(format!(
            "raw imports index ({}:{}): the lock-free storage must not know the index",
            e.file, e.line
        ));
    }
    out
}

fn source(path: &str, text: &str) -> Source {
    Source {
        module: module_path_of(Path::new(path)),
        file: path.to_string(),
        text: text.to_string(),
    }
}

#[test]
fn the_engine_has_no_import_cycle_and_raw_does_not_import_index() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let sources = read_sources(&root);
    assert!(
        sources.iter().any(|s| s.module == ["raw"])
            && sources.iter().any(|s| s.module == ["index"]),
        "the rooms are where this test expects them ({})",
        root.display()
    );
    // The graph itself, for the log (`--nocapture`): one line per room.
    if let Ok(graph) = build_graph(&sources) {
        for (from, edges) in &graph {
            let to: Vec<&str> = edges.keys().map(String::as_str).collect();
            println!("{from} -> {}", to.join(", "));
        }
    }
    let found = violations(&sources);
    assert!(
        found.is_empty(),
        "engine module rules broken:\n{}",
        found.join("\n")
    );
}

/// The checker itself: it sees `use` groups, inline paths, `super::` out of a room and root
/// re-exports, ignores comments, strings and test code, and names the cycle it finds.
#[test]
fn the_checker_names_a_planted_cycle() {
    let lib = "mod a;\nmod b;\nmod c;\npub use c::Thing;\n";
    // a -> b (grouped use), b -> c (inline path), c -> a (`super::` from a nested file).
    let cyclic = [
        source("lib.rs", lib),
        source("a.rs", "use crate::{b::X, a::Y};\n"),
        source("b.rs", "fn f() { crate::c::g(); }\n"),
        source("c/mod.rs", "mod inner;\npub struct Thing;\n"),
        source("c/inner.rs", "use super::super::a::Z;\n"),
    ];
    let found = violations(&cyclic);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("import cycle: a -> b (a.rs:1) -> c (b.rs:1) -> a (c/inner.rs:1)"),
        "{}",
        found[0]
    );

    // The same references from comments, strings, test code or within a room are no edges;
    // a root re-export resolves to its module.
    let clean = [
        source("lib.rs", lib),
        source("a.rs", "use crate::Thing;\n"),
        source(
            "b.rs",
            "// crate::a::x\nconst S: &str = \"crate::a\";\nconst R: &str = r#\"crate::a\"#;\nfn f<'a>(c: char) -> bool { c == '\"' }\n",
        ),
        source(
            "c/mod.rs",
            "mod inner;\npub struct Thing;\n#[cfg(test)]\nmod tests { use crate::a::Y; }\n#[cfg(all(test, not(loom)))]\nfn hook() { crate::b::f(); }\n",
        ),
        source("c/inner.rs", "use super::Thing;\n"),
    ];
    assert_eq!(violations(&clean), Vec::<String>::new());

    // raw -> index is refused even without a cycle; an unknown crate path is reported.
    let layered = [
        source("lib.rs", "mod raw;\nmod index;\n"),
        source("raw/mod.rs", "use crate::index::Breakdown;\n"),
        source(
            "index/mod.rs",
            "pub struct Breakdown;\nfn f() { crate::nowhere::g(); }\n",
        ),
    ];
    let found = violations(&layered);
    assert_eq!(
        found,
        vec!["unresolved crate path index/mod.rs:2: crate::nowhere".to_string()]
    );
    let layered = [
        source("lib.rs", "mod raw;\nmod index;\n"),
        source("raw/mod.rs", "use crate::index::Breakdown;\n"),
        source("index/mod.rs", "pub struct Breakdown;\n"),
    ];
    let moved = [
        source("lib.rs", "#[path = \"elsewhere.rs\"]\nmod a;\n"),
        source("elsewhere.rs", ""),
    ];
    assert_eq!(
        violations(&moved),
        vec!["lib.rs:1: a #[path] module (keep files where their modules are)".to_string()]
    );
    assert_eq!(
        violations(&layered),
        vec![
            "raw imports index (raw/mod.rs:1): the lock-free storage must not know the index"
                .to_string()
        ]
    );
}
