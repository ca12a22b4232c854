//! JSON written as the reference (Go's `encoding/json`) writes it, byte for byte: the `/snapshot`
//! body (§12.3: key order, omission rules, `[]` for empty lists, RFC 3339 times, shortest
//! float32 decimals, HTML-safe string escaping).

use inferencecache_engine::SnapshotData;
use inferencecache_tokenize::civil_from_days;
use std::fmt::Write as _;

/// Serializes snapshot data exactly as §12.3 (key order, omission rules, `[]` for empty lists,
/// RFC 3339 times, shortest f32 floats), followed by `\n`.
pub fn snapshot_json(data: &SnapshotData) -> String {
    let mut out = String::with_capacity(128 + data.replicas.len() * 256 + data.tenants.len() * 96);
    out.push_str("{\"replicas\":[");
    for (i, r) in data.replicas.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"replicaId\":");
        write_json_str(&mut out, &r.replica_id);
        if !r.tenant_id.is_empty() {
            out.push_str(",\"tenant\":");
            write_json_str(&mut out, &r.tenant_id);
        }
        let _ = write!(out, ",\"cacheMemoryBytes\":{}", r.cache_memory_bytes);
        out.push_str(",\"hitRate\":");
        write_f32(&mut out, r.hit_rate);
        out.push_str(",\"pressure\":");
        write_f32(&mut out, r.pressure);
        out.push_str(",\"lastUpdate\":\"");
        write_time(&mut out, r.last_update_us);
        let _ = write!(out, "\",\"prefixCount\":{}", r.prefix_count);
        out.push_str(",\"lastEventAt\":\"");
        write_time(&mut out, r.last_event_at_us);
        out.push('"');
        if r.stats_reported {
            out.push_str(",\"statsReported\":true");
        }
        if r.t2_hit_tokens != 0 {
            let _ = write!(out, ",\"t2HitTokens\":{}", r.t2_hit_tokens);
        }
        if r.t2_query_tokens != 0 {
            let _ = write!(out, ",\"t2QueryTokens\":{}", r.t2_query_tokens);
        }
        out.push('}');
    }
    out.push_str("],\"tenants\":[");
    for (i, t) in data.tenants.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"tenantId\":");
        write_json_str(&mut out, &t.tenant_id);
        let _ = write!(out, ",\"indexEntries\":{}", t.index_entries);
        out.push_str(",\"hitRate\":");
        write_f32(&mut out, t.hit_rate as f32);
        if t.hit_rate_reported {
            out.push_str(",\"hitRateReported\":true");
        }
        out.push_str(",\"memoryUsed\":0}");
    }
    let _ = writeln!(
        out,
        "],\"totalPrefixes\":{},\"hotPrefixes\":{}}}",
        data.total_prefixes, data.hot_prefixes
    );
    out
}

/// A float32 as Go's `encoding/json` prints it: the shortest decimal that round-trips, plain
/// notation unless the magnitude is below 1e-6 or at least 1e21 (then `1e-7`, `1e+21`).
/// Non-finite values (not representable in JSON) are written as `0`.
pub fn write_f32(out: &mut String, x: f32) {
    if !x.is_finite() {
        out.push('0');
        return;
    }
    let abs = x.abs();
    if abs != 0.0 && !(1e-6..1e21).contains(&abs) {
        let s = format!("{x:e}");
        match s.split_once('e') {
            Some((mantissa, exp)) if !exp.starts_with('-') => {
                let _ = write!(out, "{mantissa}e+{exp:0>2}");
            }
            _ => out.push_str(&s),
        }
    } else {
        let _ = write!(out, "{x}");
    }
}

/// RFC 3339 UTC with a trimmed fractional second; 0 is Go's zero time.
pub fn write_time(out: &mut String, us: i64) {
    if us == 0 {
        out.push_str("0001-01-01T00:00:00Z");
        return;
    }
    let secs = us.div_euclid(1_000_000);
    let frac_us = us.rem_euclid(1_000_000);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let _ = write!(
        out,
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
        sod / 3600,
        (sod / 60) % 60,
        sod % 60
    );
    if frac_us != 0 {
        let frac = format!("{frac_us:06}");
        out.push('.');
        out.push_str(frac.trim_end_matches('0'));
    }
    out.push('Z');
}

/// A JSON string as Go's `encoding/json` writes it (HTML-safe escaping of `<`, `>`, `&`, and of
/// U+2028/U+2029).
pub fn write_json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '<' | '>' | '&' | '\u{2028}' | '\u{2029}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------------------------
// /probe (§12.4)

#[cfg(test)]
mod tests {
    use super::*;

    fn f(x: f32) -> String {
        let mut s = String::new();
        write_f32(&mut s, x);
        s
    }

    fn t(us: i64) -> String {
        let mut s = String::new();
        write_time(&mut s, us);
        s
    }

    #[test]
    fn floats_match_go_float32_encoding() {
        assert_eq!(f(1.0), "1");
        assert_eq!(f(0.0), "0");
        assert_eq!(f(0.8), "0.8");
        assert_eq!(f(0.6), "0.6");
        assert_eq!(f(0.1), "0.1");
        assert_eq!(f(0.7), "0.7");
        assert_eq!(f(1.5), "1.5");
        assert_eq!(f(-0.25), "-0.25");
        assert_eq!(f(123456.79), "123456.79");
        assert_eq!(f(1e-6), "0.000001");
        assert_eq!(f(1e-7), "1e-7");
        assert_eq!(f(1.5e-10), "1.5e-10");
        assert_eq!(f(1e21), "1e+21");
        assert_eq!(f(1e20), "100000000000000000000");
        assert_eq!(f(f32::NAN), "0");
        // The f64 mean of two f32 values, narrowed back: (0.8 + 0.6) / 2 is not 0.7 in f32.
        assert_eq!(
            f(((0.8f32 as f64 + 0.6f32 as f64) / 2.0) as f32),
            "0.70000005"
        );
    }

    #[test]
    fn times_are_rfc3339_utc() {
        assert_eq!(t(0), "0001-01-01T00:00:00Z");
        assert_eq!(t(1_767_225_600_000_000), "2026-01-01T00:00:00Z");
        assert_eq!(t(1_772_366_400_500_000), "2026-03-01T12:00:00.5Z");
        assert_eq!(t(1_772_366_400_123_000), "2026-03-01T12:00:00.123Z");
        assert_eq!(t(1_000), "1970-01-01T00:00:00.001Z");
        assert_eq!(t(951_782_400_000_000), "2000-02-29T00:00:00Z");
        assert_eq!(t(-1_000_000), "1969-12-31T23:59:59Z");
    }

    #[test]
    fn strings_are_escaped_like_go() {
        let mut s = String::new();
        write_json_str(&mut s, "a\"b\\c\n<&>\u{1}\u{2028}é");
        assert_eq!(s, r#""a\"b\\c\n\u003c\u0026\u003e\u0001\u2028é""#);
    }

    #[test]
    fn empty_snapshot() {
        assert_eq!(
            snapshot_json(&SnapshotData::default()),
            "{\"replicas\":[],\"tenants\":[],\"totalPrefixes\":0,\"hotPrefixes\":0}\n"
        );
    }
}
