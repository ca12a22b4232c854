//! The files of each checked source tree import each other without a cycle, and the engine's
//! `raw/` (the lock-free storage) imports nothing from `index/`.
//!
//! The checked trees are [`CHECKED_TREES`]: library crates' `src/` directories, named from the
//! workspace root. Adding a crate is adding its entry there (its `main.rs` and `bin/` are other
//! crates and are not read).
//!
//! The test reads every `.rs` file of a tree and builds the graph of references between its
//! FILES. A reference is a path that lands in another file of the crate: every `crate::…`,
//! `super::…`, `self::…` path, and every path that starts with a child module's name or with a
//! name a `use` declaration brought in, whether in a `use` declaration, grouped or not, or
//! inline. A path is followed through modules and through the `use` declarations (re-exports
//! and globs) of the modules it passes, to the file that declares the item it names. A `use`
//! declaration is an edge only when the file itself uses a name it brings in (a parent's
//! `pub use child::Name` that only re-exports is not an edge; a glob that is not `pub` always
//! is, to the module it names: the names it brings in are not followed further); `mod name;`
//! declarations are not edges. So a parent that both re-exports its children
//! and is named by them (`super::Index`) is in a cycle only if it also uses a child's items.
//!
//! Comments, string and character literals are ignored, and so is test-only code: any item,
//! statement or module under `#[cfg(test)]` or `#[cfg(all(test, …))]`, and the files such a
//! module declares. Modules must live where their files are (no `#[path]`). A `crate::` or
//! `super::` path that names nothing the tree declares fails the test (it would otherwise be an
//! edge the graph silently misses).
//!
//! From the file edges the test also derives the graph of the crate's top-level modules (a
//! file belongs to the top-level module it lives in; the crate root belongs to none) and
//! checks it too: top-level rooms without a cycle, and the engine's layering (`raw` never
//! imports `index`).

use std::collections::{BTreeMap, BTreeSet};
mod common;

use common::source_text::{
    Token, code_only, rust_files, test_only_children, tokens, without_test_code,
};
use std::path::Path;

/// The source trees checked, relative to the workspace root (library crates' `src/`). To check
/// another crate, add its `src/` here, e.g. `"server/src"`.
const CHECKED_TREES: &[&str] = &["engine/src", "server/src"];

/// Top-level module pairs `(from, to)` a tree's files must never reference: the tree, the
/// module that may not import, the module it may not import.
const FORBIDDEN: &[(&str, &str, &str)] = &[("engine/src", "raw", "index")];

/// Knots of files known while their cut is pending: a tree, and the files of the knot. A knot
/// with exactly these files is reported on the log, not failed; a listed knot that is gone (or
/// changed) fails the test until its entry is removed (or updated), so the list only shrinks.
const KNOTS_PENDING: &[(&str, &[&str])] = &[];

/// One reference from a file to another, with where it was first seen.
#[derive(Debug, Clone)]
struct Edge {
    to: String,
    file: String,
    line: usize,
}

/// A graph: node → the nodes it references (first sighting each).
type Graph = BTreeMap<String, BTreeMap<String, Edge>>;

/// One name a `use` declaration brings in.
#[derive(Debug, Clone)]
struct UseName {
    /// The name it is known by in the file (`as` alias or the path's last segment); empty for
    /// a glob.
    alias: String,
    /// The path as written (`["super", "records", "Partition"]`).
    path: Vec<String>,
    glob: bool,
    public: bool,
    line: usize,
}

/// A source file, parsed.
struct Source {
    /// Its module path inside the crate (`["index", "walk"]`; the root is `[]`).
    module: Vec<String>,
    /// Its path inside the tree (`index/walk.rs`).
    file: String,
    /// The file's text (what it is built from).
    text: String,
    /// Tokens of its production code, with their lines.
    tokens: Vec<(Token, usize)>,
    /// Per token: how many inline modules (`mod name { … }`) it is in.
    inline_depths: Vec<usize>,
    /// Token index ranges of its `use` declarations.
    use_spans: Vec<(usize, usize)>,
    uses: Vec<UseName>,
    /// Names of the items it declares (at any depth: over-approximating is harmless).
    items: BTreeSet<String>,
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

fn ident(tokens: &[(Token, usize)], i: usize) -> Option<&str> {
    match tokens.get(i) {
        Some((Token::Ident(w), _)) => Some(w),
        _ => None,
    }
}

fn is_punct(tokens: &[(Token, usize)], i: usize, c: char) -> bool {
    matches!(tokens.get(i), Some((Token::Punct(p), _)) if *p == c)
}

fn is_sep(tokens: &[(Token, usize)], i: usize) -> bool {
    matches!(tokens.get(i), Some((Token::PathSep, _)))
}

/// Parses one use tree at `i` under `prefix`; returns the index after it.
fn parse_use_tree(
    tokens: &[(Token, usize)],
    mut i: usize,
    prefix: &[String],
    public: bool,
    out: &mut Vec<UseName>,
) -> usize {
    let mut path = prefix.to_vec();
    if is_sep(tokens, i) {
        // `::name`: an external crate.
        path.push(String::new());
        i += 1;
    }
    loop {
        let line = tokens.get(i).map_or(0, |t| t.1);
        if is_punct(tokens, i, '*') {
            out.push(UseName {
                alias: String::new(),
                path,
                glob: true,
                public,
                line,
            });
            return i + 1;
        }
        if is_punct(tokens, i, '{') {
            i += 1;
            while i < tokens.len() && !is_punct(tokens, i, '}') {
                i = parse_use_tree(tokens, i, &path, public, out);
                if is_punct(tokens, i, ',') {
                    i += 1;
                }
            }
            return i + 1;
        }
        let Some(name) = ident(tokens, i) else {
            return i + 1; // malformed: skip a token
        };
        i += 1;
        if is_sep(tokens, i) {
            path.push(name.to_string());
            i += 1;
            continue;
        }
        let mut alias = name.to_string();
        if name == "self" {
            alias = path.last().cloned().unwrap_or_default();
        } else {
            path.push(name.to_string());
        }
        if ident(tokens, i) == Some("as") {
            alias = ident(tokens, i + 1).unwrap_or("_").to_string();
            i += 2;
        }
        out.push(UseName {
            alias,
            path,
            glob: false,
            public,
            line,
        });
        return i;
    }
}

/// Per token, how many inline modules (`mod name { … }`) enclose it.
fn inline_depths(tokens: &[(Token, usize)]) -> Vec<usize> {
    let mut out = Vec::with_capacity(tokens.len());
    let mut braces = 0usize;
    // Brace depths at which the open inline modules' bodies end.
    let mut open: Vec<usize> = Vec::new();
    for i in 0..tokens.len() {
        if is_punct(tokens, i, '{') {
            if i >= 2 && ident(tokens, i - 2) == Some("mod") && ident(tokens, i - 1).is_some() {
                open.push(braces);
            }
            braces += 1;
        } else if is_punct(tokens, i, '}') {
            braces = braces.saturating_sub(1);
            if open.last() == Some(&braces) {
                open.pop();
            }
        }
        out.push(open.len());
    }
    out
}

/// A path written `inline` inline modules deep, as its file's module sees it: each leading
/// `super` that only leaves an inline module becomes `self` (the file is the same).
fn from_file(mut path: Vec<String>, inline: usize) -> Vec<String> {
    let supers = path.iter().take_while(|p| *p == "super").count();
    let local = supers.min(inline);
    if local > 0 {
        path.drain(..local);
        path.insert(0, "self".to_string());
        if path.get(1).map(String::as_str) == Some("self") {
            path.remove(1);
        }
        // `self::super::…` is `super::…`.
        if path.get(1).map(String::as_str) == Some("super") {
            path.remove(0);
        }
    }
    path
}

fn parse(module: Vec<String>, file: String, text: String) -> Source {
    let code = without_test_code(&code_only(&text)).unwrap_or_default();
    let tokens = tokens(&code);
    let depths = inline_depths(&tokens);
    let mut use_spans = Vec::new();
    let mut uses = Vec::new();
    let mut items = BTreeSet::new();
    const ITEM_KEYWORDS: [&str; 9] = [
        "struct", "enum", "fn", "const", "type", "trait", "static", "union", "mod",
    ];
    let mut i = 0;
    while i < tokens.len() {
        match ident(&tokens, i) {
            Some("use") if !is_sep(&tokens, i + 1) && !is_punct(&tokens, i + 1, '<') => {
                // `pub use` / `pub(crate) use`: a re-export.
                let public = ident(&tokens, i.wrapping_sub(1)) == Some("pub")
                    || (is_punct(&tokens, i.wrapping_sub(1), ')')
                        && (2..6).any(|back| ident(&tokens, i.wrapping_sub(back)) == Some("pub")));
                let start = i;
                let first = uses.len();
                let mut j = i + 1;
                while j < tokens.len() && !is_punct(&tokens, j, ';') {
                    j = parse_use_tree(&tokens, j, &[], public, &mut uses);
                    if is_punct(&tokens, j, ',') {
                        j += 1;
                    }
                }
                for u in &mut uses[first..] {
                    u.path = from_file(std::mem::take(&mut u.path), depths[i]);
                }
                use_spans.push((start, j));
                i = j + 1;
            }
            Some(keyword) if ITEM_KEYWORDS.contains(&keyword) => {
                if let Some(name) = ident(&tokens, i + 1) {
                    items.insert(name.to_string());
                }
                i += 1;
            }
            Some("macro_rules") if is_punct(&tokens, i + 1, '!') => {
                if let Some(name) = ident(&tokens, i + 2) {
                    items.insert(name.to_string());
                }
                i += 1;
            }
            _ => i += 1,
        }
    }
    Source {
        module,
        file,
        text,
        tokens,
        inline_depths: depths,
        use_spans,
        uses,
        items,
    }
}

/// The crate's files, minus the test-only ones.
struct Tree {
    sources: Vec<Source>,
    /// Module path → index in `sources`.
    by_module: BTreeMap<Vec<String>, usize>,
}

/// Where a path lands.
enum Landing {
    /// In the file of this module.
    File(Vec<String>),
    /// Outside the crate (`std::…`, another crate, a local name).
    Outside,
    /// Nowhere the crate declares.
    Unresolved,
}

impl Tree {
    fn new(all: Vec<(String, String)>) -> Self {
        let parsed: Vec<Source> = all
            .into_iter()
            .map(|(file, text)| parse(module_path_of(Path::new(&file)), file, text))
            .collect();
        // Files a test-only `mod name;` declaration pulls in: a `mod name;` in the code but
        // not in the production code.
        let mut test_only: BTreeSet<Vec<String>> = BTreeSet::new();
        for s in &parsed {
            for name in test_only_children(&s.text) {
                let mut module = s.module.clone();
                module.push(name);
                test_only.insert(module);
            }
        }
        let sources: Vec<Source> = parsed
            .into_iter()
            .filter(|s| {
                !test_only
                    .iter()
                    .any(|t| s.module.len() >= t.len() && s.module[..t.len()] == t[..])
                    && without_test_code(&code_only(&s.text)).is_some()
            })
            .collect();
        let by_module = sources
            .iter()
            .enumerate()
            .map(|(n, s)| (s.module.clone(), n))
            .collect();
        Tree { sources, by_module }
    }

    fn source(&self, module: &[String]) -> Option<&Source> {
        self.by_module.get(module).map(|&n| &self.sources[n])
    }

    fn is_module(&self, module: &[String]) -> bool {
        self.by_module.contains_key(module)
    }

    /// Where `path`, written in `from`'s file, lands.
    fn resolve(&self, from: &[String], path: &[String], depth: usize) -> Landing {
        if depth > 16 || path.is_empty() {
            return Landing::Unresolved;
        }
        let first = path[0].as_str();
        let (start, rest): (Vec<String>, &[String]) = match first {
            "crate" => (Vec::new(), &path[1..]),
            "self" => (from.to_vec(), &path[1..]),
            "super" => {
                let mut module = from.to_vec();
                let mut k = 0;
                while path.get(k).map(String::as_str) == Some("super") {
                    if module.pop().is_none() {
                        return Landing::Unresolved;
                    }
                    k += 1;
                }
                (module, &path[k..])
            }
            name => {
                let mut child = from.to_vec();
                child.push(name.to_string());
                if self.is_module(&child) {
                    (child, &path[1..])
                } else if let Some(u) = self
                    .source(from)
                    .and_then(|s| s.uses.iter().find(|u| !u.glob && u.alias == name))
                {
                    if u.path[0] == name {
                        // `use name;`, `use name::{self, name}`: an external crate's path.
                        return Landing::Outside;
                    }
                    let mut full = u.path.clone();
                    full.extend_from_slice(&path[1..]);
                    return self.resolve(from, &full, depth + 1);
                } else {
                    return Landing::Outside;
                }
            }
        };
        self.walk(start, rest, depth)
    }

    /// Follows `rest` down from `module`.
    fn walk(&self, module: Vec<String>, rest: &[String], depth: usize) -> Landing {
        let Some(source) = self.source(&module) else {
            return Landing::Unresolved;
        };
        let Some(segment) = rest.first() else {
            return Landing::File(module);
        };
        let mut child = module.clone();
        child.push(segment.clone());
        if self.is_module(&child) {
            return self.walk(child, &rest[1..], depth + 1);
        }
        if segment == "self" {
            return Landing::File(module);
        }
        if source.items.contains(segment) {
            return Landing::File(module);
        }
        if let Some(u) = source.uses.iter().find(|u| !u.glob && u.alias == *segment) {
            // A re-export: the item is where the `use` points.
            return self.resolve(&module, &u.path, depth + 1);
        }
        for glob in source.uses.iter().filter(|u| u.glob) {
            if let Landing::File(target) = self.resolve(&module, &glob.path, depth + 1)
                && let landing @ Landing::File(_) = self.walk(target, rest, depth + 1)
            {
                return landing;
            }
        }
        Landing::Unresolved
    }

    fn file_of(&self, module: &[String]) -> String {
        self.source(module)
            .map_or_else(String::new, |s| s.file.clone())
    }

    /// The file graph; unresolved `crate::`/`super::` paths as `file:line: path`.
    fn file_graph(&self) -> (Graph, Vec<String>) {
        let mut graph: Graph = self
            .sources
            .iter()
            .map(|s| (s.file.clone(), BTreeMap::new()))
            .collect();
        let mut unresolved = Vec::new();
        for s in &self.sources {
            let mut add = |landing: Landing, line: usize, written: &[String]| match landing {
                Landing::File(target) => {
                    let to = self.file_of(&target);
                    if to != s.file {
                        graph
                            .get_mut(&s.file)
                            .expect("every file is a node")
                            .entry(to.clone())
                            .or_insert(Edge {
                                to,
                                file: s.file.clone(),
                                line,
                            });
                    }
                }
                Landing::Outside => {}
                Landing::Unresolved => {
                    unresolved.push(format!("{}:{line}: {}", s.file, written.join("::")))
                }
            };
            // `use` declarations: an edge when the file uses a name they bring in.
            let outside_uses = |name: &str| {
                s.tokens.iter().enumerate().any(|(n, (t, _))| {
                    matches!(t, Token::Ident(w) if w == name)
                        && !s.use_spans.iter().any(|&(a, b)| n >= a && n <= b)
                })
            };
            for u in &s.uses {
                let in_crate = matches!(
                    u.path.first().map(String::as_str),
                    Some("crate" | "super" | "self")
                );
                let landing = self.resolve(&s.module, &u.path, 0);
                if matches!(landing, Landing::Unresolved) && !in_crate {
                    continue; // `use name::…` of something this tree does not declare
                }
                let used = if u.glob {
                    !u.public
                } else {
                    outside_uses(&u.alias)
                };
                if used || matches!(landing, Landing::Unresolved) {
                    add(landing, u.line, &u.path);
                }
            }
            // Inline paths.
            let t = &s.tokens;
            let mut i = 0;
            while i < t.len() {
                if let Some(&(a, b)) = s.use_spans.iter().find(|&&(a, _)| a == i) {
                    let _ = a;
                    i = b + 1;
                    continue;
                }
                let starts_path = ident(t, i).is_some()
                    && is_sep(t, i + 1)
                    && !is_sep(t, i.wrapping_sub(1))
                    && !is_punct(t, i.wrapping_sub(1), '.');
                if !starts_path {
                    i += 1;
                    continue;
                }
                let line = t[i].1;
                let mut path = Vec::new();
                let mut j = i;
                while let Some(w) = ident(t, j) {
                    path.push(w.to_string());
                    if is_sep(t, j + 1) && ident(t, j + 2).is_some() {
                        j += 2;
                    } else {
                        break;
                    }
                }
                let path = from_file(path, s.inline_depths[i]);
                let first = path[0].as_str();
                let mut child = s.module.clone();
                child.push(first.to_string());
                let ours = matches!(first, "crate" | "super" | "self")
                    || self.is_module(&child)
                    || s.uses.iter().any(|u| !u.glob && u.alias == first);
                if ours {
                    let landing = self.resolve(&s.module, &path, 0);
                    add(landing, line, &path);
                }
                i = j + 1;
            }
        }
        (graph, unresolved)
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

/// Every knot of the graph (a strongly connected component of two or more nodes, in node
/// order), each as its members and one cycle through them.
fn knots(graph: &Graph) -> Vec<(Vec<String>, Vec<Edge>)> {
    // Tarjan's algorithm, recursive (graphs of a few hundred files).
    struct State<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        out: Vec<Vec<String>>,
    }
    fn connect<'g>(node: &'g str, s: &mut State<'g>) {
        let n = s.index.len();
        s.index.insert(node, n);
        s.low.insert(node, n);
        s.stack.push(node);
        s.on_stack.insert(node);
        let graph = s.graph;
        for edge in graph.get(node).map(|e| e.values()).into_iter().flatten() {
            let to = edge.to.as_str();
            if !s.index.contains_key(to) {
                connect(to, s);
                let low = s.low[node].min(s.low[to]);
                s.low.insert(node, low);
            } else if s.on_stack.contains(to) {
                let low = s.low[node].min(s.index[to]);
                s.low.insert(node, low);
            }
        }
        if s.low[node] == s.index[node] {
            let mut members = Vec::new();
            while let Some(top) = s.stack.pop() {
                s.on_stack.remove(top);
                members.push(top.to_string());
                if top == node {
                    break;
                }
            }
            if members.len() > 1 {
                members.sort();
                s.out.push(members);
            }
        }
    }
    let mut state = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for node in graph.keys() {
        if !state.index.contains_key(node.as_str()) {
            connect(node, &mut state);
        }
    }
    let mut components = state.out;
    components.sort();
    components
        .into_iter()
        .map(|members| {
            let inside: BTreeSet<&String> = members.iter().collect();
            let sub: Graph = members
                .iter()
                .map(|m| {
                    let edges = graph[m]
                        .iter()
                        .filter(|(to, _)| inside.contains(to))
                        .map(|(to, e)| (to.clone(), e.clone()))
                        .collect();
                    (m.clone(), edges)
                })
                .collect();
            let cycle = find_cycle(&sub).unwrap_or_default();
            (members, cycle)
        })
        .collect()
}

fn describe(cycle: &[Edge]) -> String {
    // The cycle starts where its last edge ends.
    let mut s = cycle.last().map(|e| e.to.clone()).unwrap_or_default();
    for e in cycle {
        s.push_str(&format!(" -> {} ({}:{})", e.to, e.file, e.line));
    }
    s
}

/// The graph of top-level modules the file graph implies (the crate root is no node).
fn room_graph(tree: &Tree, files: &Graph) -> Graph {
    let room_of: BTreeMap<&str, Option<&String>> = tree
        .sources
        .iter()
        .map(|s| (s.file.as_str(), s.module.first()))
        .collect();
    let mut rooms: Graph = BTreeMap::new();
    for (from, edges) in files {
        let Some(Some(from_room)) = room_of.get(from.as_str()) else {
            continue;
        };
        let node = rooms.entry((*from_room).clone()).or_default();
        for e in edges.values() {
            if let Some(Some(to_room)) = room_of.get(e.to.as_str())
                && to_room != from_room
            {
                node.entry((*to_room).clone()).or_insert(Edge {
                    to: (*to_room).clone(),
                    file: e.file.clone(),
                    line: e.line,
                });
            }
        }
    }
    rooms
}

/// The violations of the module rules in one tree (`name` picks its [`FORBIDDEN`] pairs).
fn violations(name: &str, files: Vec<(String, String)>, pending: &[&[&str]]) -> Vec<String> {
    let mut out = Vec::new();
    // A `#[path]` module lives where its file does not say: the graph would misplace it.
    for (file, text) in &files {
        for (n, line) in code_only(text).lines().enumerate() {
            if line.trim_start().starts_with("#[path") {
                out.push(format!(
                    "{file}:{}: a #[path] module (keep files where their modules are)",
                    n + 1
                ));
            }
        }
    }
    let tree = Tree::new(files);
    let (graph, unresolved) = tree.file_graph();
    out.extend(
        unresolved
            .into_iter()
            .map(|u| format!("unresolved path {u}")),
    );
    let file_knots = knots(&graph);
    for files in pending {
        if !file_knots.iter().any(|(members, _)| members == files) {
            out.push(format!(
                "KNOTS_PENDING lists a knot that is gone or changed: {} (remove or update it)",
                files.join(", ")
            ));
        }
    }
    for (members, cycle) in file_knots {
        if pending.iter().any(|files| members == *files) {
            println!("pending knot ({name}): {}", describe(&cycle));
            continue;
        }
        out.push(format!("import cycle between files: {}", describe(&cycle)));
        if members.len() > cycle.len() {
            out.push(format!("  (the knot: {})", members.join(", ")));
        }
    }
    let rooms = room_graph(&tree, &graph);
    for (members, cycle) in knots(&rooms) {
        out.push(format!(
            "import cycle between top-level modules: {}",
            describe(&cycle)
        ));
        if members.len() > cycle.len() {
            out.push(format!("  (the knot: {})", members.join(", ")));
        }
    }
    for &(tree_name, from, to) in FORBIDDEN {
        if tree_name == name
            && let Some(e) = rooms.get(from).and_then(|edges| edges.get(to))
        {
            out.push(format!(
                "{from} imports {to} ({}:{}): the layering forbids it",
                e.file, e.line
            ));
        }
    }
    out
}

fn read_tree(root: &Path) -> Vec<(String, String)> {
    let mut paths = Vec::new();
    rust_files(root, &mut paths);
    paths
        .into_iter()
        .filter_map(|path| {
            let relative = path.strip_prefix(root).expect("under the source root");
            let file = relative.display().to_string();
            // Another crate's root, and what it declares.
            if file == "main.rs" || file.starts_with("bin/") {
                return None;
            }
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            Some((file, text))
        })
        .collect()
}

#[test]
fn checked_trees_have_no_import_cycle_between_files() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut found = Vec::new();
    for &name in CHECKED_TREES {
        let root = workspace.join(name);
        let files = read_tree(&root);
        assert!(
            files.iter().any(|(f, _)| f == "lib.rs"),
            "{name} is a library crate's source tree ({})",
            root.display()
        );
        // The graph itself, for the log (`--nocapture`): one line per file.
        let tree = Tree::new(files.clone());
        let (graph, _) = tree.file_graph();
        println!("{name}:");
        for (from, edges) in &graph {
            let to: Vec<&str> = edges.keys().map(String::as_str).collect();
            println!("  {from} -> {}", to.join(", "));
        }
        let pending: Vec<&[&str]> = KNOTS_PENDING
            .iter()
            .filter(|(tree_name, _)| *tree_name == name)
            .map(|(_, files)| *files)
            .collect();
        found.extend(
            violations(name, files, &pending)
                .into_iter()
                .map(|v| format!("{name}: {v}")),
        );
    }
    assert!(
        found.is_empty(),
        "module rules broken:\n{}",
        found.join("\n")
    );
}

fn files(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(f, t)| (f.to_string(), t.to_string()))
        .collect()
}

/// The checker itself: it sees `use` groups, inline paths, `super::` and child paths, root and
/// parent re-exports, inline modules, ignores comments, strings and test code, and names the
/// cycle it finds.
#[test]
fn the_checker_names_a_planted_cycle() {
    let lib = "mod a;\nmod b;\nmod c;\npub use c::Thing;\n";
    // a -> b (grouped use), b -> c/mod (inline path), c/mod -> c/inner (a child's path),
    // c/inner -> a (`super::super`).
    let cyclic = files(&[
        ("lib.rs", lib),
        (
            "a.rs",
            "use crate::{b::X, a::Y};\nfn f(_: X) {}\npub struct Y;\n",
        ),
        (
            "b.rs",
            "use anyhow::anyhow;\npub struct X;\nfn f() -> anyhow::Result<()> { crate::c::g(); Err(anyhow!(\"x\")) }\n",
        ),
        (
            "c/mod.rs",
            "mod inner;\npub struct Thing;\npub fn g() { inner::h() }\n",
        ),
        ("c/inner.rs", "use super::super::a::Y;\npub fn h(_: Y) {}\n"),
    ]);
    assert_eq!(
        violations("test", cyclic.clone(), &[]),
        vec![
            "import cycle between files: a.rs -> b.rs (a.rs:1) -> c/mod.rs (b.rs:3) \
             -> c/inner.rs (c/mod.rs:3) -> a.rs (c/inner.rs:1)"
                .to_string(),
            "import cycle between top-level modules: a -> b (a.rs:1) -> c (b.rs:3) \
             -> a (c/inner.rs:1)"
                .to_string(),
        ]
    );

    // A pending knot is tolerated while it is exactly the listed files; once it is gone, its
    // entry is reported.
    let pending: &[&[&str]] = &[&["a.rs", "b.rs", "c/inner.rs", "c/mod.rs"]];
    let found = violations("test", cyclic.clone(), pending);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("import cycle between top-level modules"));
    assert_eq!(
        violations("test", files(&[("lib.rs", "")]), pending),
        vec![
            "KNOTS_PENDING lists a knot that is gone or changed: a.rs, b.rs, c/inner.rs, \
             c/mod.rs (remove or update it)"
                .to_string()
        ]
    );

    // The same references from comments, strings, test code or unused re-exports are no
    // edges; a root re-export resolves to the file that declares the item.
    let clean = files(&[
        ("lib.rs", lib),
        (
            "a.rs",
            "use crate::Thing;\nfn f(_: Thing) {}\npub struct Y;\n",
        ),
        (
            "b.rs",
            "// crate::a::Y\nconst S: &str = \"crate::a\";\nconst R: &str = r#\"crate::a\"#;\nfn f<'a>(c: char) -> bool { c == '\"' }\n",
        ),
        (
            "c/mod.rs",
            "mod inner;\npub use inner::Thing;\npub struct Parent;\n#[cfg(test)]\nmod tests { use crate::a::Y; }\n#[cfg(all(test, not(loom)))]\nfn hook() { crate::b::f(); }\n#[cfg(test)]\nmod testing;\n",
        ),
        (
            "c/inner.rs",
            "use super::Parent;\npub struct Thing(Parent);\nfn h() {}\nmod deep {\n    use super::Thing;\n    fn f(_: Thing) { super::h() }\n}\n",
        ),
        ("c/testing.rs", "use crate::a::Y;\n"),
    ]);
    assert_eq!(violations("test", clean, &[]), Vec::<String>::new());

    // A parent that uses what it re-exports (here in a field) is in a cycle with a child
    // that names the parent.
    let knotted = files(&[
        ("lib.rs", "mod c;\n"),
        (
            "c/mod.rs",
            "mod inner;\npub use inner::Thing;\npub struct Parent { thing: Thing }\n",
        ),
        (
            "c/inner.rs",
            "pub struct Thing;\nfn f(_: &super::Parent) {}\n",
        ),
    ]);
    assert_eq!(
        violations("test", knotted, &[]),
        vec![
            "import cycle between files: c/inner.rs -> c/mod.rs (c/inner.rs:2) \
             -> c/inner.rs (c/mod.rs:2)"
                .to_string()
        ]
    );

    // A forbidden pair is refused even without a cycle; an unknown crate path is reported.
    let layered = files(&[
        ("lib.rs", "mod raw;\nmod index;\n"),
        (
            "raw/mod.rs",
            "use crate::index::Breakdown;\nfn f(_: Breakdown) {}\n",
        ),
        (
            "index/mod.rs",
            "pub struct Breakdown;\nfn f() { crate::nowhere::g(); }\n",
        ),
    ]);
    assert_eq!(
        violations("engine/src", layered, &[]),
        vec![
            "unresolved path index/mod.rs:2: crate::nowhere::g".to_string(),
            "raw imports index (raw/mod.rs:1): the layering forbids it".to_string()
        ]
    );
    let moved = files(&[
        ("lib.rs", "#[path = \"elsewhere.rs\"]\nmod a;\n"),
        ("elsewhere.rs", ""),
    ]);
    assert_eq!(
        violations("test", moved, &[]),
        vec!["lib.rs:1: a #[path] module (keep files where their modules are)".to_string()]
    );
}
