//! Calendar arithmetic, outside the `hf` feature because the server uses it too.

/// Howard Hinnant's `civil_from_days`: days since 1970-01-01 → (year, month 1..=12, day 1..=31)
/// in the proleptic Gregorian calendar.
///
/// Public only so the server's control plane (RFC 3339 timestamps) shares this conversion with
/// `strftime_now` instead of keeping a copy; it is not part of the tokenization API proper.
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}
