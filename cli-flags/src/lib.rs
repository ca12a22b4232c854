//! Go-style command lines for the server and the sidecar: the reference implementation's `flag`
//! package accepts `-long-flag` as well as `--long-flag`, clap only the latter. Both binaries
//! rewrite their arguments with [`normalize_args`] before parsing, so the rule lives here once.
//! Likewise Go duration values ([`parse_duration`]), for both binaries' duration flags.

mod duration;

pub use duration::{GoDuration, ParseDurationError, parse_duration};

use std::ffi::OsString;

/// Rewrites single-dash long flags (`-grpc-bind-address x`, `-log-level=debug`) into double-dash
/// form. Short flags (`-h`, `-V`), the program name and values are left alone; `bool_flags` names
/// the long flags that take no value, so the argument after one is still read as a flag (a value
/// such as `-1s` after a flag that takes one is never rewritten).
pub fn normalize_args(
    args: impl IntoIterator<Item = OsString>,
    bool_flags: &[&str],
) -> Vec<OsString> {
    let takes_value = |name: &str| !bool_flags.contains(&name);
    let mut out = Vec::new();
    let mut expect_value = false;
    for (i, arg) in args.into_iter().enumerate() {
        if i == 0 || expect_value {
            expect_value = false;
            out.push(arg);
            continue;
        }
        match arg.to_str() {
            Some(s) if s.starts_with("--") => {
                let name = s[2..].split('=').next().unwrap_or("");
                expect_value = !s.contains('=') && takes_value(name);
                out.push(arg);
            }
            Some(s) if s.starts_with('-') && s.len() > 2 => {
                let name = s[1..].split('=').next().unwrap_or("");
                // Only flag-shaped names: a negative number or other dash-led text stays as is.
                if name.len() > 1 && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
                    expect_value = !s.contains('=') && takes_value(name);
                    out.push(OsString::from(format!("-{s}")));
                } else {
                    out.push(arg);
                }
            }
            _ => out.push(arg),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(args: &[&str], bool_flags: &[&str]) -> Vec<String> {
        normalize_args(args.iter().map(OsString::from), bool_flags)
            .into_iter()
            .map(|a| a.into_string().expect("UTF-8 test argument"))
            .collect()
    }

    #[test]
    fn single_dash_long_flags_get_a_second_dash() {
        assert_eq!(
            norm(
                &["-bin", "-grpc-bind-address", ":1", "-log-level=debug"],
                &[]
            ),
            ["-bin", "--grpc-bind-address", ":1", "--log-level=debug"]
        );
    }

    #[test]
    fn values_are_never_rewritten() {
        // `-1s` is the value of `--ttl` / `-ttl`, not a flag.
        assert_eq!(norm(&["bin", "--ttl", "-1s"], &[]), ["bin", "--ttl", "-1s"]);
        assert_eq!(
            norm(&["bin", "-ttl", "-10m"], &[]),
            ["bin", "--ttl", "-10m"]
        );
        // With `=`, the next argument is a flag again.
        assert_eq!(
            norm(&["bin", "-ttl=1s", "-log-level", "x"], &[]),
            ["bin", "--ttl=1s", "--log-level", "x"]
        );
    }

    #[test]
    fn bool_flags_take_no_value() {
        assert_eq!(
            norm(&["bin", "-insecure", "-port", "1"], &["insecure"]),
            ["bin", "--insecure", "--port", "1"]
        );
        assert_eq!(
            norm(&["bin", "--insecure", "-port", "1"], &["insecure"]),
            ["bin", "--insecure", "--port", "1"]
        );
        // Not declared boolean: the next argument is its value.
        assert_eq!(
            norm(&["bin", "-insecure", "-port"], &[]),
            ["bin", "--insecure", "-port"]
        );
    }

    #[test]
    fn short_flags_and_other_dash_text_stay() {
        assert_eq!(
            norm(&["bin", "-h", "-V", "-", "-1", "-a.b"], &[]),
            ["bin", "-h", "-V", "-", "-1", "-a.b"]
        );
    }
}
