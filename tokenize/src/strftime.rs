//! `strftime_now(format)`, the Hugging Face chat-template helper
//! (`datetime.now().strftime(format)` in `transformers`).
//!
//! Time is taken as **UTC** (servers run in UTC; there is no time-zone database here). The
//! common C/Python conversion specifiers are supported, including glibc's `-` flag (no padding,
//! e.g. `%-d`); an unknown specifier is copied through unchanged, as glibc does.

use crate::calendar::civil_from_days;
use std::time::{SystemTime, UNIX_EPOCH};

const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// A broken-down UTC time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Civil {
    year: i64,
    month: u32, // 1..=12
    day: u32,   // 1..=31
    hour: u32,
    minute: u32,
    second: u32,
    weekday: u32, // 0 = Monday
    yday: u32,    // 1..=366
}

impl Civil {
    pub(crate) fn from_unix(secs: i64) -> Civil {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400);
        let (year, month, day) = civil_from_days(days);
        // 1970-01-01 was a Thursday (3 with Monday = 0).
        let weekday = (days + 3).rem_euclid(7) as u32;
        let yday = (days - days_from_civil(year, 1, 1) + 1) as u32;
        Civil {
            year,
            month,
            day,
            hour: (rem / 3600) as u32,
            minute: (rem / 60 % 60) as u32,
            second: (rem % 60) as u32,
            weekday,
            yday,
        }
    }
}

/// The inverse of [`civil_from_days`]: (year, month, day) → days since 1970-01-01.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The template function: formats the current UTC time.
pub(crate) fn strftime_now(format: &str) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    format_civil(format, &Civil::from_unix(secs))
}

pub(crate) fn format_civil(format: &str, t: &Civil) -> String {
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let Some(spec) = chars.next() else {
            out.push('%');
            if no_pad {
                out.push('-');
            }
            break;
        };
        let num = |out: &mut String, v: i64, width: usize| {
            if no_pad {
                out.push_str(&v.to_string());
            } else {
                out.push_str(&format!("{v:0width$}"));
            }
        };
        let hour12 = match t.hour % 12 {
            0 => 12,
            h => h,
        };
        match spec {
            'a' => out.push_str(&WEEKDAYS[t.weekday as usize][..3]),
            'A' => out.push_str(WEEKDAYS[t.weekday as usize]),
            'b' | 'h' => out.push_str(&MONTHS[t.month as usize - 1][..3]),
            'B' => out.push_str(MONTHS[t.month as usize - 1]),
            'd' => num(&mut out, i64::from(t.day), 2),
            'e' => {
                if no_pad {
                    num(&mut out, i64::from(t.day), 0);
                } else {
                    out.push_str(&format!("{:2}", t.day));
                }
            }
            'm' => num(&mut out, i64::from(t.month), 2),
            'y' => num(&mut out, t.year.rem_euclid(100), 2),
            'Y' => out.push_str(&t.year.to_string()),
            'H' => num(&mut out, i64::from(t.hour), 2),
            'I' => num(&mut out, i64::from(hour12), 2),
            'M' => num(&mut out, i64::from(t.minute), 2),
            'S' => num(&mut out, i64::from(t.second), 2),
            'j' => num(&mut out, i64::from(t.yday), 3),
            'p' => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            'u' => out.push_str(&(t.weekday + 1).to_string()),
            'w' => out.push_str(&((t.weekday + 1) % 7).to_string()),
            'F' => out.push_str(&format!("{}-{:02}-{:02}", t.year, t.month, t.day)),
            'T' => out.push_str(&format!("{:02}:{:02}:{:02}", t.hour, t.minute, t.second)),
            'D' => out.push_str(&format!(
                "{:02}/{:02}/{:02}",
                t.month,
                t.day,
                t.year.rem_euclid(100)
            )),
            'R' => out.push_str(&format!("{:02}:{:02}", t.hour, t.minute)),
            'Z' => out.push_str("UTC"),
            'z' => out.push_str("+0000"),
            'n' => out.push('\n'),
            't' => out.push('\t'),
            '%' => out.push('%'),
            other => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{Civil, days_from_civil, format_civil};

    #[test]
    fn civil_conversion_round_trips() {
        for days in [-800_000i64, -1, 0, 1, 59, 10_957, 11_016, 19_782, 2_932_896] {
            let c = Civil::from_unix(days * 86_400);
            assert_eq!(days_from_civil(c.year, c.month, c.day), days);
        }
    }

    #[test]
    fn formats_known_instant() {
        // 2024-02-29T13:05:09Z, a Thursday, day 60 of a leap year.
        let t = Civil::from_unix(1_709_211_909);
        assert_eq!(
            format_civil("%d %b %Y|%A %B %-d, %y|%H:%M:%S %I%p|%j %F %T %Z %%|%q", &t),
            "29 Feb 2024|Thursday February 29, 24|13:05:09 01PM|060 2024-02-29 13:05:09 UTC %|%q"
        );
        let epoch = Civil::from_unix(0);
        assert_eq!(format_civil("%a %e %-m %u %w", &epoch), "Thu  1 1 4 4");
    }
}
