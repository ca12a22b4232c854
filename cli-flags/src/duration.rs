//! The grammar of Go duration flag values (`time.ParseDuration`: `1h30m`, `1.5s`, `-2s`). Only the
//! grammar is shared: the server reads a non-positive duration as "unset" while the sidecar keeps
//! the sign, and each reports errors in its own words, so the callers handle `0`, the empty
//! string and the sum of the terms themselves.

use std::num::ParseFloatError;

/// Why the body of a Go duration did not parse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DurationError {
    /// The body does not start with a number (`ms`, or `-1s` after a second sign).
    MissingNumber,
    /// A term's number is malformed (`1.2.3s`).
    BadNumber(ParseFloatError),
    /// The last number has no unit (`5`, `1m30`).
    MissingUnit,
    /// A unit other than `ns`, `us`, `µs`, `μs`, `ms`, `s`, `m` and `h`.
    UnknownUnit(String),
}

/// Splits off a leading `-` (true) or `+` (false); without a sign the duration is positive.
pub fn split_duration_sign(s: &str) -> (bool, &str) {
    match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    }
}

/// The terms of an unsigned Go duration (`1h30m` → 3600e9, 1800e9) in nanoseconds, in order. An
/// empty body has no terms. The terms are not summed here because the callers round differently
/// (per term or once at the end), and each keeps its own rounding.
pub fn duration_terms_ns(body: &str) -> Result<Vec<f64>, DurationError> {
    let mut terms = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if digits == 0 {
            return Err(DurationError::MissingNumber);
        }
        let value: f64 = rest[..digits].parse().map_err(DurationError::BadNumber)?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit_ns: f64 = match &rest[..unit_len] {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            "" => return Err(DurationError::MissingUnit),
            other => return Err(DurationError::UnknownUnit(other.to_string())),
        };
        rest = &rest[unit_len..];
        terms.push(value * unit_ns);
    }
    Ok(terms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terms_in_nanoseconds() {
        assert_eq!(duration_terms_ns("1h30m"), Ok(vec![3600e9, 1800e9]));
        assert_eq!(duration_terms_ns("1.5s"), Ok(vec![1.5e9]));
        assert_eq!(
            duration_terms_ns("2us3µs4μs5ns"),
            Ok(vec![2e3, 3e3, 4e3, 5.0])
        );
        assert_eq!(duration_terms_ns(""), Ok(vec![]));
    }

    #[test]
    fn malformed_terms() {
        assert_eq!(duration_terms_ns("ms"), Err(DurationError::MissingNumber));
        assert_eq!(duration_terms_ns("-1s"), Err(DurationError::MissingNumber));
        assert!(matches!(
            duration_terms_ns("1.2.3s"),
            Err(DurationError::BadNumber(_))
        ));
        assert_eq!(duration_terms_ns("1m30"), Err(DurationError::MissingUnit));
        assert_eq!(
            duration_terms_ns("5d"),
            Err(DurationError::UnknownUnit("d".to_string()))
        );
    }

    #[test]
    fn signs() {
        assert_eq!(split_duration_sign("-2s"), (true, "2s"));
        assert_eq!(split_duration_sign("+2s"), (false, "2s"));
        assert_eq!(split_duration_sign("2s"), (false, "2s"));
        assert_eq!(split_duration_sign("-"), (true, ""));
    }
}
