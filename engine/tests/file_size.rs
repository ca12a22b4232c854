//! No production file of the checked crates is over [`LIMIT`] lines: a file that grows past it
//! is a room to split (its reader cannot hold it), not a file to append to.
//!
//! Production lines are a file's lines minus its test code: files named `tests.rs` or below a
//! `tests/` directory, the files a `#[cfg(test)] mod name;` declares, and the lines of every item
//! under `#[cfg(test)]` or `#[cfg(all(test, …))]` (from its attribute through its closing line).
//! Comments and blank lines count: they are part of what a reader reads.
//!
//! [`OVER_LIMIT`] lists the files known to be over the limit while their split is pending. The
//! list only shrinks: a listed file that is back within the limit fails the test until its entry
//! is removed, and an unlisted file over the limit fails it too.

mod common;

use common::source_text::{code_only, rust_files, test_only_children, test_only_lines};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The most lines a production file may have.
const LIMIT: usize = 1_000;

/// The source trees checked, relative to the workspace root.
const CHECKED_TREES: &[&str] = &["engine/src", "server/src", "sidecar/src"];

/// Files over the limit whose split is pending (workspace-relative paths).
const OVER_LIMIT: &[&str] = &[];

/// Production lines of a file's text.
fn production_lines(text: &str) -> usize {
    let lines = text.lines().count();
    let test = test_only_lines(&code_only(text))
        .into_iter()
        .filter(|&t| t)
        .count();
    lines - test.min(lines)
}

/// The production files of a tree: every `.rs` file but the test ones.
fn production_files(root: &Path) -> Vec<PathBuf> {
    let mut all = Vec::new();
    rust_files(root, &mut all);
    // Test-only child modules: `dir/name.rs` or `dir/name/…` of a file that declares them.
    let mut test_only: BTreeSet<PathBuf> = BTreeSet::new();
    for path in &all {
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let stem = path.file_stem().unwrap_or_default().to_string_lossy();
        let dir = path.parent().unwrap_or(root);
        // A `mod.rs`, `lib.rs` or `main.rs` declares children beside it; `a.rs` in `a/`.
        let children_dir = if ["mod", "lib", "main"].contains(&stem.as_ref()) {
            dir.to_path_buf()
        } else {
            dir.join(stem.as_ref())
        };
        for name in test_only_children(&text) {
            test_only.insert(children_dir.join(format!("{name}.rs")));
            test_only.insert(children_dir.join(&name));
        }
    }
    all.into_iter()
        .filter(|path| {
            let relative = path.strip_prefix(root).unwrap_or(path);
            path.file_name().is_none_or(|n| n != "tests.rs")
                && !relative.iter().any(|part| part == "tests")
                && !test_only.iter().any(|t| path.starts_with(t))
        })
        .collect()
}

#[test]
fn no_production_file_is_over_the_limit() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut over = Vec::new();
    let mut sizes = Vec::new();
    for tree in CHECKED_TREES {
        let root = workspace.join(tree);
        let files = production_files(&root);
        assert!(!files.is_empty(), "{tree} has source files");
        for path in files {
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            let name = format!(
                "{tree}/{}",
                path.strip_prefix(&root).unwrap_or(&path).display()
            );
            let lines = production_lines(&text);
            sizes.push((lines, name.clone()));
            if lines > LIMIT {
                over.push((name, lines));
            }
        }
    }
    // The largest files, for the log (`--nocapture`).
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    for (lines, name) in sizes.iter().take(10) {
        println!("{lines:>6} {name}");
    }
    let mut broken = Vec::new();
    for (name, lines) in &over {
        if !OVER_LIMIT.contains(&name.as_str()) {
            broken.push(format!(
                "{name}: {lines} production lines (over {LIMIT}: split it)"
            ));
        }
    }
    for listed in OVER_LIMIT {
        if !over.iter().any(|(name, _)| name == listed) {
            broken.push(format!(
                "{listed} is listed in OVER_LIMIT but is within {LIMIT} lines (or gone): remove \
                 its entry"
            ));
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// The counting itself: test items, test files and test-only modules do not count.
#[test]
fn test_code_is_not_counted() {
    let text = "fn a() {}\n\n#[cfg(test)]\nmod tests {\n    #[test]\n    fn t() {}\n\n}\n\
                #[cfg(all(test, not(loom)))]\nfn helper() {}\nfn b() {}\n";
    // `fn a`, the blank line, `fn b`.
    assert_eq!(production_lines(text), 3);
    assert_eq!(production_lines("#![cfg(test)]\nfn a() {}\n"), 0);

    let dir = std::env::temp_dir().join(format!("file-size-check-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for (file, text) in [
        ("lib.rs", "mod a;\n#[cfg(test)]\nmod testing;\n"),
        ("a.rs", "#[cfg(test)]\nmod tests;\nmod b;\n"),
        ("a/tests.rs", ""),
        ("a/b.rs", ""),
        ("testing.rs", ""),
        ("tests/helper.rs", ""),
    ] {
        let path = dir.join(file);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("creating a directory");
        std::fs::write(&path, text).expect("writing a file");
    }
    let found: Vec<String> = production_files(&dir)
        .iter()
        .map(|p| p.strip_prefix(&dir).expect("inside").display().to_string())
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(found, ["a/b.rs", "a.rs", "lib.rs"]);
}
