//! Model-id safety rules (`server.md` §7.3).

/// Whether `id` is an acceptable model id.
///
/// A model id is a slash-joined relative path such as `Qwen/Qwen2.5-0.5B-Instruct`. It is
/// **unsafe** when it is empty, absolute (leading `/`), contains a backslash or a NUL byte, starts
/// with a drive prefix such as `C:` / `C:/`, is not path-clean (double, leading or trailing
/// slashes), or has an empty, `.` or `..` segment.
///
/// Ids are only ever looked up in the map loaded at startup; this check is a second line of
/// defence so that no request-supplied id that *looks* like a path is ever treated as one.
///
/// ```
/// use inferencecache_tokenize::is_safe_model_id;
/// assert!(is_safe_model_id("Qwen/Qwen2.5-0.5B-Instruct"));
/// assert!(!is_safe_model_id("../etc/passwd"));
/// assert!(!is_safe_model_id("C:/models/x"));
/// ```
pub fn is_safe_model_id(id: &str) -> bool {
    if id.is_empty() || id.starts_with('/') || id.contains('\\') || id.contains('\0') {
        return false;
    }
    if has_drive_prefix(id) {
        return false;
    }
    // Every segment must be non-empty and neither `.` nor `..`: this also rejects a trailing
    // slash and `//`, which together with the checks above is exactly "path-clean".
    id.split('/')
        .all(|seg| !seg.is_empty() && seg != "." && seg != "..")
}

/// `C:`, `c:foo`, `C:/x`: an ASCII letter followed by a colon at the start.
fn has_drive_prefix(id: &str) -> bool {
    let b = id.as_bytes();
    b.len() >= 2 && b[0].is_ascii_alphabetic() && b[1] == b':'
}

#[cfg(test)]
mod tests {
    use super::is_safe_model_id;

    #[test]
    fn accepts_plain_and_nested_ids() {
        for id in [
            "gpt2",
            "Qwen/Qwen2.5-0.5B-Instruct",
            "org/team/model-v1.5",
            "a.b/c..d",
            ".hidden/model",
            "model:tag",
        ] {
            assert!(is_safe_model_id(id), "{id:?} should be safe");
        }
    }

    #[test]
    fn rejects_unsafe_ids() {
        for id in [
            "",
            "/abs/model",
            "/",
            "org\\model",
            "C:/models/x",
            "c:model",
            "C:",
            "org//model",
            "org/model/",
            "./model",
            "org/./model",
            "..",
            "../model",
            "org/../model",
            "org/..",
            ".",
            "nul\0byte",
        ] {
            assert!(!is_safe_model_id(id), "{id:?} should be unsafe");
        }
    }
}
