//! Every relative link in the repository's Markdown files resolves inside the repository.
//!
//! The test walks every `.md` file of the repository (skipping build output `target*/`, hidden
//! directories, `node_modules/`, Python caches and the peers' checkouts under `bench/peers/`)
//! and checks three kinds of reference, outside fenced code blocks:
//! - inline links and images, `[text](dest)` and `![alt](dest)`;
//! - reference definitions, `[label]: dest`;
//! - code spans that name a Markdown file by a relative path with a directory
//!   (`` `docs/engine.md` ``, `` `results/w1m.md` ``), since a reader follows those like links.
//!
//! A destination with a scheme (`https:`, `mailto:`) is not checked. A relative one must name a
//! file or directory that exists, resolved against the linking file's directory (code spans may
//! also be written from the repository root). A `#anchor` into a Markdown file must name one of
//! its headings, as GitHub derives them (lower case, punctuation other than `-` and `_` dropped,
//! spaces turned into `-`, a repeated heading suffixed `-1`, `-2`…) or an explicit
//! `<a name=…>`/`<a id=…>`. Paths under `target/` in code spans name generated output and are
//! not checked.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

fn repository_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the engine crate sits in the repository root")
        .to_path_buf()
}

fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            let skipped = name.starts_with('.')
                || name.starts_with("target")
                || name == "node_modules"
                || name == "__pycache__"
                || path.ends_with("bench/peers");
            if !skipped {
                markdown_files(&path, out);
            }
        } else if name.ends_with(".md") {
            out.push(path);
        }
    }
}

/// The text with fenced code blocks blanked (line count kept, so line numbers stay right).
fn without_fences(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut fence: Option<&str> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        let opens = ["```", "~~~"].into_iter().find(|f| trimmed.starts_with(f));
        match (fence, opens) {
            (None, Some(f)) => fence = Some(f),
            (Some(open), Some(f)) if f == open => fence = None,
            (None, None) => out.push_str(line),
            _ => {}
        }
        out.push('\n');
    }
    out
}

/// GitHub's anchor for a heading's text.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors a Markdown file offers.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    for line in without_fences(text).lines() {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
            let title = line[hashes..].trim().trim_end_matches('#').replace('`', "");
            let base = slug(&title);
            let seen = counts.entry(base.clone()).or_insert(0);
            out.insert(if *seen == 0 {
                base.clone()
            } else {
                format!("{base}-{seen}")
            });
            *seen += 1;
        }
    }
    for marker in ["<a name=\"", "<a id=\""] {
        for (at, _) in text.match_indices(marker) {
            let rest = &text[at + marker.len()..];
            if let Some(end) = rest.find('"') {
                out.insert(rest[..end].to_string());
            }
        }
    }
    out
}

/// One reference found in a file: its destination, line, and whether it came from a code span.
struct Reference {
    destination: String,
    line: usize,
    code_span: bool,
}

fn references(text: &str) -> Vec<Reference> {
    let mut out = Vec::new();
    for (number, line) in without_fences(text).lines().enumerate() {
        let line_number = number + 1;
        // Code spans: checked only when they name a Markdown file by a path with a directory.
        let mut prose = String::with_capacity(line.len());
        let mut parts = line.split('`');
        let mut inside = false;
        if let Some(first) = parts.next() {
            prose.push_str(first);
        }
        for part in parts {
            inside = !inside;
            if inside {
                let path = part.split('#').next().unwrap_or_default();
                let is_path = path.ends_with(".md")
                    && path.contains('/')
                    && path
                        .chars()
                        .all(|c| c.is_alphanumeric() || matches!(c, '/' | '.' | '-' | '_'));
                if is_path {
                    out.push(Reference {
                        destination: part.to_string(),
                        line: line_number,
                        code_span: true,
                    });
                }
                prose.push_str("``");
            } else {
                prose.push_str(part);
            }
        }
        // Reference definitions: `[label]: destination`.
        let trimmed = prose.trim_start();
        if trimmed.starts_with('[')
            && let Some(close) = trimmed.find("]:")
            && let Some(destination) = trimmed[close + 2..].split_whitespace().next()
        {
            out.push(Reference {
                destination: destination.trim_matches(['<', '>']).to_string(),
                line: line_number,
                code_span: false,
            });
        }
        // Inline links and images: `](destination)` or `](destination "title")`.
        for (at, _) in prose.match_indices("](") {
            let rest = &prose[at + 2..];
            let Some(end) = rest.find(')') else {
                continue;
            };
            let inner = rest[..end].trim();
            let destination = inner.split_whitespace().next().unwrap_or_default();
            out.push(Reference {
                destination: destination.trim_matches(['<', '>']).to_string(),
                line: line_number,
                code_span: false,
            });
        }
    }
    out
}

fn has_scheme(destination: &str) -> bool {
    let Some(colon) = destination.find(':') else {
        return false;
    };
    let scheme = &destination[..colon];
    !scheme.is_empty()
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '.' | '-'))
        && scheme.starts_with(|c: char| c.is_ascii_alphabetic())
}

/// Why `reference` in `file` does not resolve, if it does not.
fn check(root: &Path, file: &Path, reference: &Reference) -> Option<String> {
    let destination = reference.destination.as_str();
    if destination.is_empty() || has_scheme(destination) {
        return None;
    }
    let (path, anchor) = match destination.split_once('#') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (destination, None),
    };
    if reference.code_span && (path.starts_with("target/") || path.contains("/target/")) {
        return None;
    }
    let directory = file.parent().unwrap_or(root);
    let target = if path.is_empty() {
        file.to_path_buf()
    } else {
        let beside = directory.join(path);
        if !beside.exists() && reference.code_span && root.join(path).exists() {
            root.join(path)
        } else {
            beside
        }
    };
    if !target.exists() {
        return Some(format!("{destination}: no such file"));
    }
    let canonical = target.canonicalize().ok()?;
    if !canonical.starts_with(root.canonicalize().ok()?) {
        return Some(format!("{destination}: outside the repository"));
    }
    if let Some(anchor) = anchor
        && target.extension().is_some_and(|e| e == "md")
    {
        let text = fs::read_to_string(&target).unwrap_or_default();
        if !anchors(&text).contains(anchor) {
            return Some(format!("{destination}: no heading with anchor #{anchor}"));
        }
    }
    None
}

#[test]
fn every_relative_markdown_link_resolves() {
    let root = repository_root();
    let mut files = Vec::new();
    markdown_files(&root, &mut files);
    files.sort();
    assert!(
        files.iter().any(|f| f.ends_with("docs/server.md")),
        "the walk found the documents"
    );
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for reference in references(&text) {
            checked += 1;
            if let Some(why) = check(&root, file, &reference) {
                let shown = file.strip_prefix(&root).unwrap_or(file);
                broken.push(format!("{}:{}: {why}", shown.display(), reference.line));
            }
        }
    }
    assert!(checked > 0, "no link was found in {} files", files.len());
    assert!(
        broken.is_empty(),
        "{} of {checked} relative links do not resolve:\n{}",
        broken.len(),
        broken.join("\n")
    );
}

#[test]
fn the_checker_sees_links_code_spans_and_anchors() {
    let text = "# A `b` title\n## Title\n## Title\n[x](docs/a.md#b) and ![i](img.png \"t\")\n\
                [ref]: ../c.md\nsee `bench/d.md` and `plain` and `a.md`\n```\n[no](fenced.md)\n```\n";
    let found: Vec<(String, usize, bool)> = references(text)
        .into_iter()
        .map(|r| (r.destination, r.line, r.code_span))
        .collect();
    assert_eq!(
        found,
        vec![
            ("docs/a.md#b".to_string(), 4, false),
            ("img.png".to_string(), 4, false),
            ("../c.md".to_string(), 5, false),
            ("bench/d.md".to_string(), 6, true),
        ]
    );
    let anchors = anchors(text);
    for expected in ["a-b-title", "title", "title-1"] {
        assert!(anchors.contains(expected), "{expected} in {anchors:?}");
    }
    assert_eq!(slug("§7.1 Handler (H1–H13)"), "71-handler-h1h13");
    assert!(has_scheme("https://example.com") && !has_scheme("docs/a.md"));
}
