//! `docs/rules.md` resolves every rule ID the repository cites.
//!
//! Code, tests and documents cite the specification's stable IDs (`// K11`, "(D8)", `t23_…`) so a
//! reader can check a line against the rule it implements. The specification lives outside the
//! repository; `docs/rules.md` restates each ID in one line. This test walks the repository's own
//! source and document files, collects every cited ID and fails with the list of IDs that
//! `docs/rules.md` has no row for, so a new citation cannot land without its statement (and a
//! typo, an ID outside every family's range, shows up in the list).
//!
//! What counts as a citation (one pattern, shared with `docs/rules.md`'s own rows):
//! - the rule families `K L E R O V S G N C H D P`: the letter and a number without a leading
//!   zero (`K1`, `H13`, `P8`);
//! - the test families `T SV SC F`: the letter(s) and exactly two digits (`T01`, `SV27`, `SC13`,
//!   `F03`), so the tier names `T1`–`T3` and constants such as `T0` are not citations;
//! - in a name made of underscore-separated words (a test named after its scenarios,
//!   `sv41_probe_tenant_and_sv44_tiers`, `stress_t91`), every lower-case word of a test family,
//!   read upper-cased.
//!
//! The tokens in [`NOT_RULE_IDS`] have the same shape but another meaning; they are the only
//! exceptions. The W1M query classes `Q0`, `Q50`, `Q100` are workload names, not rules, and no
//! family above matches them.
//!
//! The walk skips build output (`target/`), hidden directories (`.git/`, `.venv/`; `.ci/` is
//! read), Python caches and builds, the fuzz corpora and artifacts (binary inputs), and every file
//! whose extension is not a source or document format.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Same-shape tokens that are not rule IDs, with the meaning they have where they occur.
const NOT_RULE_IDS: &[(&str, &str)] = &[
    ("C11", "the C11 memory model (loom-tests/README.md)"),
    ("F32", "the MessagePack float variant `Value::F32`"),
    ("F64", "the MessagePack float variant `Value::F64`"),
    ("P50", "a latency percentile"),
    ("P90", "a latency percentile"),
    ("P95", "a latency percentile"),
    ("P99", "a latency percentile"),
];

/// Rule families: a letter and a number without a leading zero.
const RULE_FAMILIES: &[&str] = &[
    "K", "L", "E", "R", "O", "V", "S", "G", "N", "C", "H", "D", "P",
];
/// Test families: letters and exactly two digits.
const TEST_FAMILIES: &[&str] = &["T", "SV", "SC", "F"];

/// File extensions whose text may cite IDs.
const SCANNED_EXTENSIONS: &[&str] = &["rs", "md", "py", "sh", "toml", "proto", "yaml", "yml"];
/// Extension-less files that are scripts.
const SCANNED_NAMES: &[&str] = &["run"];
/// Directory names never entered (at any depth).
const SKIPPED_DIRECTORIES: &[&str] = &[
    "target",
    "node_modules",
    "__pycache__",
    "build",
    "dist",
    "venv",
    "corpus",
    "artifacts",
    "coverage",
];

/// The file under test, relative to the repository root.
const RULES_DOC: &str = "docs/rules.md";

/// Every ID cited in `text`, as written in `docs/rules.md` (upper case).
fn cited_ids(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    // IDs are whole tokens (maximal runs of word characters), or, in a test named after its
    // scenarios (`sv41_probe_tenant_and_sv44_tiers`), the lower-case segments between
    // underscores. The scan works on bytes (every ID is ASCII, and a non-ASCII byte is never a
    // word byte) and looks closer only at tokens holding a digit: the test stays fast unoptimized.
    let bytes = text.as_bytes();
    let mut start = 0;
    while start < bytes.len() {
        if !is_word_byte(bytes[start]) {
            start += 1;
            continue;
        }
        let mut end = start;
        let mut has_digit = false;
        while end < bytes.len() && is_word_byte(bytes[end]) {
            has_digit |= bytes[end].is_ascii_digit();
            end += 1;
        }
        if has_digit {
            // Word bytes are ASCII, so both ends are character boundaries.
            let token = &text[start..end];
            if let Some(id) = parse_id(token) {
                found.push(id);
            } else if token.contains('_') {
                found.extend(token.split('_').filter_map(test_id_of_segment));
            }
        }
        start = end;
    }
    found
}

fn is_word_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_'
}

/// The test ID a lower-case name segment cites (`t23` → `T23`), if any.
fn test_id_of_segment(segment: &str) -> Option<String> {
    if segment.is_empty()
        || !segment
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return None;
    }
    let upper = segment.to_ascii_uppercase();
    let letters = upper.trim_end_matches(|c: char| c.is_ascii_digit());
    if !TEST_FAMILIES.contains(&letters) {
        return None;
    }
    parse_id(&upper)
}

/// `token` if it is exactly one ID of a family, else `None`.
fn parse_id(token: &str) -> Option<String> {
    let digits_at = token.find(|c: char| c.is_ascii_digit())?;
    let (letters, digits) = token.split_at(digits_at);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let shaped = if RULE_FAMILIES.contains(&letters) {
        (1..=2).contains(&digits.len()) && !digits.starts_with('0')
    } else if TEST_FAMILIES.contains(&letters) {
        digits.len() == 2
    } else {
        false
    };
    if !shaped || NOT_RULE_IDS.iter().any(|(id, _)| *id == token) {
        return None;
    }
    Some(token.to_owned())
}

fn repository_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the engine crate lives one level below the repository root")
        .to_path_buf()
}

fn is_scanned_file(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    match path.extension().and_then(|e| e.to_str()) {
        Some(extension) => SCANNED_EXTENSIONS.contains(&extension),
        None => SCANNED_NAMES.contains(&name),
    }
}

fn is_skipped_directory(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    (name.starts_with('.') && name != ".ci")
        || SKIPPED_DIRECTORIES.contains(&name)
        || name.ends_with(".egg-info")
        || name.starts_with("target-")
}

/// Every scanned file below `directory`, in a stable order.
fn collect_files(directory: &Path, files: &mut Vec<PathBuf>) {
    // A directory or entry that vanishes under the walk (another test's scratch files) is
    // skipped; the count checks in the test catch a walk that found nothing.
    let Ok(listing) = fs::read_dir(directory) else {
        return;
    };
    let mut entries: Vec<PathBuf> = listing
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .collect();
    entries.sort();
    for path in entries {
        // Links are not followed (a link into `target/` or out of the repository is not ours
        // to scan): their metadata is neither a file nor a directory here.
        let Ok(metadata) = fs::symlink_metadata(&path) else {
            continue;
        };
        if metadata.is_dir() {
            if !is_skipped_directory(&path) {
                collect_files(&path, files);
            }
        } else if metadata.is_file() && is_scanned_file(&path) {
            files.push(path);
        }
    }
}

/// The IDs of `docs/rules.md`'s rows, in document order.
fn documented_ids(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| line.strip_prefix('|'))
        .filter_map(|row| parse_id(row.split('|').next().unwrap_or("").trim()))
        .collect()
}

/// Family letters and number of an ID that [`parse_id`] accepted.
fn family_and_number(id: &str) -> (&str, u32) {
    let digits_at = id
        .find(|c: char| c.is_ascii_digit())
        .expect("an ID has digits");
    let (family, digits) = id.split_at(digits_at);
    (family, digits.parse().expect("an ID's digits are a number"))
}

fn read_rules_doc() -> (PathBuf, String) {
    let path = repository_root().join(RULES_DOC);
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    (path, text)
}

#[test]
fn the_pattern_finds_citations_and_only_citations() {
    let text = "K11 step 2, (D8), H1–H13, `// V5`, SV27 and T01; t23_chain_run, \
                sv41_probe_and_sv44_tiers, stress_t91, sc13_e2e, f01_golden; tier::T1, T0_US, \
                T0, Q50, Q100, W1M, P99, C11, Value::F64, as_secs_f64, 0xD8, E731, HBM3, TLS12, \
                K01, T1_, t1_x, st01_x, SV1, F5, k11_x";
    assert_eq!(
        cited_ids(text),
        [
            "K11", "D8", "H1", "H13", "V5", "SV27", "T01", "T23", "SV41", "SV44", "T91", "SC13",
            "F01"
        ]
    );
}

#[test]
fn every_cited_rule_id_has_a_row_in_docs_rules_md() {
    let root = repository_root();
    let (rules_path, rules_text) = read_rules_doc();
    let documented: BTreeSet<String> = documented_ids(&rules_text).into_iter().collect();

    let mut files = Vec::new();
    collect_files(&root, &mut files);
    assert!(
        files.len() > 100,
        "the walk found only {} files under {}",
        files.len(),
        root.display()
    );

    // ID → the first files citing it, for the failure message.
    let mut missing: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut cited = 0usize;
    for path in &files {
        if path == &rules_path {
            continue;
        }
        // A file that is not UTF-8 is not a source or document file.
        let Ok(text) = fs::read_to_string(path) else {
            continue;
        };
        for id in cited_ids(&text) {
            cited += 1;
            if !documented.contains(&id) {
                let relative = path.strip_prefix(&root).unwrap_or(path);
                let citing = missing.entry(id).or_default();
                let name = relative.display().to_string();
                if citing.len() < 3 && !citing.contains(&name) {
                    citing.push(name);
                }
            }
        }
    }
    assert!(
        cited > 1000,
        "only {cited} citations found: the walk is missing files"
    );
    assert!(
        missing.is_empty(),
        "{RULES_DOC} lacks a row for these cited IDs (ID: citing files): {missing:#?}"
    );
}

/// One section per family, rows in ascending order without repeats, so a reader finds an ID
/// where it belongs and an ID has exactly one statement.
#[test]
fn docs_rules_md_rows_are_grouped_by_family_and_ordered() {
    let (_, rules_text) = read_rules_doc();
    let ids = documented_ids(&rules_text);
    assert!(ids.len() > 100, "only {} rows in {RULES_DOC}", ids.len());
    let mut closed_families: BTreeSet<&str> = BTreeSet::new();
    let mut previous: Option<(&str, u32)> = None;
    for id in &ids {
        let (family, number) = family_and_number(id);
        match previous {
            Some((previous_family, previous_number)) if previous_family == family => assert!(
                number > previous_number,
                "{RULES_DOC}: {id} follows {previous_family}{previous_number} (rows must ascend, \
                 one per ID)"
            ),
            _ => {
                if let Some((previous_family, _)) = previous {
                    closed_families.insert(previous_family);
                }
                assert!(
                    !closed_families.contains(family),
                    "{RULES_DOC}: {id} is outside its family's section"
                );
            }
        }
        previous = Some((family, number));
    }
}
