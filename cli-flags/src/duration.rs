//! Go duration flag values (`time.ParseDuration`: `1h30m`, `1.5s`, `-2s`, `0`).
//!
//! [`parse_duration`] reads one into its sign and magnitude; what a zero or negative duration
//! means is the caller's (the server reads either as "unset", the sidecar's "or off" flags
//! refuse a negative one and its "or default" flags read both as the default), so both ends
//! share one parse and one rounding. Each term is cut to whole nanoseconds before the
//! (saturating) sum.

use std::num::ParseFloatError;
use std::time::Duration;

/// Why the body of a Go duration did not parse.
#[derive(Debug, Clone, PartialEq, Eq)]
enum DurationError {
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
fn split_duration_sign(s: &str) -> (bool, &str) {
    match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    }
}

/// The terms of an unsigned Go duration (`1h30m` → 3600e9, 1800e9) in nanoseconds, in order. An
/// empty body has no terms. The terms are not summed here because the callers round differently
/// (per term or once at the end), and each keeps its own rounding.
fn duration_terms_ns(body: &str) -> Result<Vec<f64>, DurationError> {
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

/// A Go duration as written: its sign and its magnitude.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GoDuration {
    /// Written with a leading `-`.
    pub negative: bool,
    /// The magnitude (saturating at `u64::MAX` nanoseconds).
    pub magnitude: Duration,
}

impl GoDuration {
    /// The duration when it is positive; `None` when it is zero or negative.
    pub fn positive(self) -> Option<Duration> {
        (!self.negative && !self.magnitude.is_zero()).then_some(self.magnitude)
    }
}

/// Why a Go duration flag value did not parse; the message quotes the value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseDurationError {
    message: String,
    source: Option<ParseFloatError>,
}

impl std::fmt::Display for ParseDurationError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ParseDurationError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Parses a Go duration (`500ms`, `90s`, `1h30m`, `-2s`; units ns, us, µs, μs, ms, s, m, h).
/// `0` alone (signed or not) needs no unit; an empty value is an error.
pub fn parse_duration(s: &str) -> Result<GoDuration, ParseDurationError> {
    let s = s.trim();
    let error = |message: String| ParseDurationError {
        message,
        source: None,
    };
    let (negative, rest) = split_duration_sign(s);
    if rest == "0" {
        return Ok(GoDuration {
            negative,
            magnitude: Duration::ZERO,
        });
    }
    if rest.is_empty() {
        return Err(error("empty duration".to_string()));
    }
    let terms = duration_terms_ns(rest).map_err(|e| match e {
        DurationError::MissingNumber => error(format!("invalid duration {s:?}")),
        DurationError::BadNumber(e) => ParseDurationError {
            message: format!("invalid duration {s:?}"),
            source: Some(e),
        },
        DurationError::MissingUnit => error(format!("missing unit in duration {s:?}")),
        DurationError::UnknownUnit(unit) => {
            error(format!("unknown unit {unit:?} in duration {s:?}"))
        }
    })?;
    let total_ns = terms
        .iter()
        .fold(0u128, |total, &term| total.saturating_add(term as u128));
    Ok(GoDuration {
        negative,
        magnitude: Duration::from_nanos(u64::try_from(total_ns).unwrap_or(u64::MAX)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_durations() {
        let parsed = |s: &str| parse_duration(s).map(|d| (d.negative, d.magnitude));
        assert_eq!(parsed("30m"), Ok((false, Duration::from_secs(1800))));
        assert_eq!(parsed("1h30m"), Ok((false, Duration::from_secs(5400))));
        assert_eq!(parsed("500ms"), Ok((false, Duration::from_millis(500))));
        assert_eq!(parsed(" 1.5s "), Ok((false, Duration::from_millis(1500))));
        assert_eq!(parsed("-2s"), Ok((true, Duration::from_secs(2))));
        assert_eq!(parsed("0"), Ok((false, Duration::ZERO)));
        assert_eq!(parsed("-0"), Ok((true, Duration::ZERO)));
        // Each term is cut to whole nanoseconds before the sum.
        assert_eq!(parsed("1.5ns1.5ns"), Ok((false, Duration::from_nanos(2))));
        assert_eq!(
            parsed("9999999999h"),
            Ok((false, Duration::from_nanos(u64::MAX)))
        );
        assert_eq!(parse_duration("-2s").unwrap().positive(), None);
        assert_eq!(parse_duration("0").unwrap().positive(), None);
        assert_eq!(
            parse_duration("2s").unwrap().positive(),
            Some(Duration::from_secs(2))
        );
    }

    #[test]
    fn refused_durations_say_why() {
        let message = |s: &str| parse_duration(s).unwrap_err().to_string();
        assert_eq!(message(""), "empty duration");
        assert_eq!(message("-"), "empty duration");
        assert_eq!(message("5"), "missing unit in duration \"5\"");
        assert_eq!(message("5d"), "unknown unit \"d\" in duration \"5d\"");
        assert_eq!(message("ms"), "invalid duration \"ms\"");
        let bad_number = parse_duration("1.2.3s").unwrap_err();
        assert_eq!(bad_number.to_string(), "invalid duration \"1.2.3s\"");
        assert!(std::error::Error::source(&bad_number).is_some());
    }

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
