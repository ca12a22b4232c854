//! Reading the workspace's own source text, for the tests that check its structure
//! (`module_graph.rs`, `file_size.rs`, `lock_family.rs`): the files, the code without comments,
//! literals or test items, and its tokens.

use std::path::{Path, PathBuf};

/// Every `.rs` file below `dir`, in path order.
pub fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// The text with comments and the contents of string and character literals blanked out
/// (newlines kept, so line numbers still hold).
pub fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
        } else if c == 'r'
            && (i == 0 || !is_ident(chars[i - 1]) || chars[i - 1] == 'b')
            && matches!(next, Some('"') | Some('#'))
            && {
                let mut j = i + 1;
                while chars.get(j) == Some(&'#') {
                    j += 1;
                }
                chars.get(j) == Some(&'"')
            }
        {
            // Raw string: r"…", r#"…"#, br"…".
            let mut j = i + 1;
            let mut hashes = 0;
            while chars[j] == '#' {
                hashes += 1;
                j += 1;
            }
            j += 1;
            out.push_str("\"\"");
            loop {
                if j >= chars.len() {
                    break;
                }
                if chars[j] == '"' && (0..hashes).all(|h| chars.get(j + 1 + h) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                out.push(blank(chars[j]));
                j += 1;
            }
            i = j;
        } else if c == '"' {
            out.push_str("\"\"");
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < chars.len() {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
            i += 1;
        } else if c == '\'' && next == Some('\\') {
            // Escaped character literal.
            i += 2;
            while i < chars.len() && chars[i] != '\'' {
                i += 1;
            }
            i += 1;
            out.push_str("' '");
        } else if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            i += 3;
            out.push_str("' '");
        } else {
            // Everything else, lifetimes and labels included.
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Whether a `#[cfg(…)]` attribute's predicate makes its item test-only.
pub fn is_test_only(predicate: &str) -> bool {
    let p: String = predicate.chars().filter(|c| !c.is_whitespace()).collect();
    p == "test" || p.starts_with("all(test,") || p == "all(test)"
}

/// The code with every test-only item blanked out (newlines kept). Returns `None` when the
/// whole file is test-only (`#![cfg(test)]`).
pub fn without_test_code(code: &str) -> Option<String> {
    let chars: Vec<char> = code.chars().collect();
    let keep = test_mask(&chars)?;
    Some(
        chars
            .iter()
            .zip(&keep)
            .map(|(&c, &k)| if k || c == '\n' { c } else { ' ' })
            .collect(),
    )
}

/// Per line of `code`: whether the line lies wholly inside a test-only item (its attribute
/// line through its closing line). Every line when the whole file is test-only.
pub fn test_only_lines(code: &str) -> Vec<bool> {
    let chars: Vec<char> = code.chars().collect();
    let line_count = code.lines().count();
    let Some(keep) = test_mask(&chars) else {
        return vec![true; line_count];
    };
    let mut out = Vec::with_capacity(line_count);
    let mut line_is_test = true;
    let mut line_has_chars = false;
    for (c, k) in chars.iter().zip(&keep) {
        if *c == '\n' {
            // A blank line belongs where its newline does.
            out.push(if line_has_chars { line_is_test } else { !k });
            line_is_test = true;
            line_has_chars = false;
        } else {
            line_has_chars = true;
            line_is_test &= !k;
        }
    }
    if line_has_chars {
        out.push(line_is_test);
    }
    out
}

/// Per character: `false` inside a test-only item (`#[cfg(test)]`, `#[cfg(all(test, …))]`),
/// from its attribute through the end of the item. `None` when the whole file is test-only.
fn test_mask(chars: &[char]) -> Option<Vec<bool>> {
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
    Some(keep)
}

/// The names of the child modules a file declares only for tests (`#[cfg(test)] mod name;`):
/// their files are test code.
pub fn test_only_children(text: &str) -> Vec<String> {
    let code = code_only(text);
    let kept = without_test_code(&code).unwrap_or_default();
    let mut out = Vec::new();
    for (line, kept_line) in code.lines().zip(kept.lines()) {
        let declared = line
            .trim()
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub(super) ")
            .trim_start_matches("pub ")
            .strip_prefix("mod ")
            .and_then(|rest| rest.strip_suffix(';'))
            .map(str::trim);
        if let Some(name) = declared
            && kept_line.trim().is_empty()
        {
            out.push(name.to_string());
        }
    }
    out
}

/// A token of the code: an identifier (or a number), `::`, or one punctuation character.
#[derive(Debug, Clone, PartialEq)]
pub enum Token {
    Ident(String),
    PathSep,
    Punct(char),
}

/// The tokens of `code` with the line each starts on.
pub fn tokens(code: &str) -> Vec<(Token, usize)> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push((Token::Ident(chars[start..i].iter().collect()), line));
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push((Token::PathSep, line));
            i += 2;
        } else {
            out.push((Token::Punct(c), line));
            i += 1;
        }
    }
    out
}
