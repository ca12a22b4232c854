//! One lock family: every lock in the engine comes from `crate::sync`, the loom seam, so a
//! `--cfg loom` build checks all of them. The test reads `engine/src/**/*.rs` and fails if a file
//! other than `sync.rs` names `parking_lot` or a lock type of `std::sync` or `loom::sync`
//! (`Mutex`, `RwLock`, `Condvar` and their guards), whether by a full path, a grouped `use`
//! (`use std::{sync::{Arc, Mutex}}`) or an import of the module itself (`use std::sync;`,
//! `std::sync::{self, …}`), which would let a later `sync::Mutex` slip by. Comments and
//! string literals are ignored.

mod common;

use common::source_text::{Token, code_only, rust_files, tokens};
use std::path::Path;

/// Lock types a file must take from `crate::sync`.
const LOCK_TYPES: &[&str] = &[
    "Mutex",
    "MutexGuard",
    "RwLock",
    "RwLockReadGuard",
    "RwLockWriteGuard",
    "Condvar",
];

/// Every full path the path (or use tree) starting at token `at` spells: `a::b::{c, d::{e}}`
/// gives `a::b::c` and `a::b::d::e`. A path that stops at a `::` or a `{` it cannot close
/// gives what it has.
fn paths_from(tokens: &[(Token, usize)], at: usize) -> Vec<Vec<String>> {
    fn tree(
        tokens: &[(Token, usize)],
        mut i: usize,
        prefix: Vec<String>,
    ) -> (Vec<Vec<String>>, usize) {
        let mut path = prefix;
        loop {
            match tokens.get(i).map(|t| &t.0) {
                Some(Token::Ident(name)) => {
                    path.push(name.clone());
                    i += 1;
                }
                Some(Token::Punct('{')) => {
                    let mut all = Vec::new();
                    i += 1;
                    loop {
                        match tokens.get(i).map(|t| &t.0) {
                            None => return (all, i),
                            Some(Token::Punct('}')) => return (all, i + 1),
                            Some(Token::Punct(',')) => i += 1,
                            // `x as y`: the alias names nothing.
                            Some(Token::Ident(word)) if word == "as" => i += 2,
                            Some(_) => {
                                let (inner, next) = tree(tokens, i, path.clone());
                                all.extend(inner);
                                if next == i {
                                    i += 1; // not a path: step over it
                                } else {
                                    i = next;
                                }
                            }
                        }
                    }
                }
                _ => return (vec![path], i),
            }
            if tokens.get(i).map(|t| &t.0) == Some(&Token::PathSep) {
                i += 1;
            } else {
                return (vec![path], i);
            }
        }
    }
    tree(tokens, at, Vec::new()).0
}

/// What `file`'s code names outside the seam: `file:line: path` for each offence.
fn offences(file: &str, text: &str) -> Vec<String> {
    let code = code_only(text);
    let tokens = tokens(&code);
    let mut found = Vec::new();
    for (i, (token, line)) in tokens.iter().enumerate() {
        let Token::Ident(name) = token else {
            continue;
        };
        if name == "parking_lot" {
            found.push(format!("{file}:{line}: parking_lot"));
            continue;
        }
        // Only where a path starts (`::std` included): `x::std::sync` is someone else's `std`.
        let inner = i >= 2
            && tokens[i - 1].0 == Token::PathSep
            && matches!(tokens[i - 2].0, Token::Ident(_));
        let starts = !inner;
        if !starts || (name != "std" && name != "loom") {
            continue;
        }
        for path in paths_from(&tokens, i) {
            let is_lock = match path.as_slice() {
                [_, sync] => sync == "sync",
                [_, sync, last, ..] => {
                    sync == "sync" && (last == "self" || LOCK_TYPES.contains(&last.as_str()))
                }
                _ => false,
            };
            if is_lock {
                found.push(format!("{file}:{line}: {}", path.join("::")));
            }
        }
    }
    found
}

#[test]
fn every_engine_lock_comes_from_the_sync_seam() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(files.len() > 20, "found the engine's sources");
    let mut found = Vec::new();
    for path in &files {
        let relative = path.strip_prefix(&root).expect("under the source root");
        if relative == Path::new("sync.rs") {
            continue;
        }
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        found.extend(offences(&relative.display().to_string(), &text));
    }
    assert!(
        found.is_empty(),
        "locks named outside crate::sync:\n{}",
        found.join("\n")
    );
}

/// The checker finds each way of naming a lock, and ignores comments, strings and the std items
/// that are not locks.
#[test]
fn the_checker_names_planted_locks() {
    let text = "\
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
// use parking_lot::Mutex;
const S: &str = \"std::sync::Mutex\";
use parking_lot::RwLock;
use std::sync::{Arc as A, Mutex};
use std::{collections::HashMap, sync::{OnceLock, atomic::AtomicBool, Condvar}};
fn f() -> std::sync::MutexGuard<'static, ()> { todo!() }
use std::sync;
use std::sync::{self, mpsc};
static L: loom::sync::RwLock<()> = todo!();
fn g() { ::std::sync::Condvar::new(); }
use crate::sync::{Mutex, RwLock};
";
    let found = offences("planted.rs", text);
    assert_eq!(
        found,
        [
            "planted.rs:5: parking_lot",
            "planted.rs:6: std::sync::Mutex",
            "planted.rs:7: std::sync::Condvar",
            "planted.rs:8: std::sync::MutexGuard",
            "planted.rs:9: std::sync",
            "planted.rs:10: std::sync::self",
            "planted.rs:11: loom::sync::RwLock",
            "planted.rs:12: std::sync::Condvar::new",
        ]
    );
}
