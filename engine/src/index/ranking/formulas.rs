//! Pure ranking arithmetic (index.md §4, L6). Every step in the order the spec states.

use crate::config::RankerConfig;

/// L6 freshness: `ttl ≤ 0 → 0`; `age ≤ 0 → 1`; `age ≥ ttl → 0`; else `1 − age/ttl` in f64,
/// narrowed to f32. All arguments in ms.
#[inline]
pub fn freshness(now_ms: i64, last_seen_ms: i64, ttl_ms: i64) -> f32 {
    if ttl_ms <= 0 {
        return 0.0;
    }
    let age = now_ms - last_seen_ms;
    if age <= 0 {
        return 1.0;
    }
    if age >= ttl_ms {
        return 0.0;
    }
    (1.0 - age as f64 / ttl_ms as f64) as f32
}

/// L6 liveness without division: `f > 0 ⇔ ttl > 0 ∧ age < ttl`.
#[inline]
pub(crate) fn is_live(now_ms: i64, last_seen_ms: i64, ttl_ms: i64) -> bool {
    ttl_ms > 0 && now_ms - last_seen_ms < ttl_ms
}

/// R4 distinguishing power `dp(m, n)` in f64.
#[inline]
pub fn distinguishing_power(m: i64, n: i64) -> f64 {
    if n <= 1 || m < 0 {
        return 1.0;
    }
    if m >= n {
        return 0.0;
    }
    1.0 - m as f64 / n as f64
}

/// R2 pressure factor `clamp(1 − W·p, 0, 1)` in f32.
#[inline]
pub fn pressure_factor(w: f32, p: f32) -> f32 {
    (1.0 - w * p).clamp(0.0, 1.0)
}

/// R3 SLO constant `c`.
#[inline]
pub fn slo_c(cfg: &RankerConfig, ttft_ms: i32) -> f32 {
    if cfg.slo_tight_ttft_ms <= 0 || cfg.slo_tight_bias <= 0.0 {
        return 0.0;
    }
    if ttft_ms <= 0 || ttft_ms >= cfg.slo_tight_ttft_ms {
        return 0.0;
    }
    cfg.slo_tight_bias
}

/// R1 PREFIX_MATCH score before dp: `((tokens × fresh) × pf) × (1 + fresh·c)`.
#[inline]
pub fn prefix_score(tokens: i32, fresh: f32, pf: f32, c: f32) -> f32 {
    let slo = 1.0 + fresh * c;
    ((tokens as f32 * fresh) * pf) * slo
}

/// R7 recency of TENANT_HOT (ages in ms, computed in ns as f32).
#[inline]
pub fn recency(age_ms: i64, max_age_ms: i64) -> f32 {
    if age_ms <= 0 {
        return 1.0;
    }
    if age_ms >= max_age_ms {
        return 0.0;
    }
    let a = age_ms.saturating_mul(1_000_000) as f32;
    let m = max_age_ms.saturating_mul(1_000_000) as f32;
    1.0 - a / m
}

/// R7 TENANT_HOT score `((hit × recency) × pf) × (1 + recency·c)`.
#[inline]
pub fn tenant_hot_score(hit: f32, rec: f32, pf: f32, c: f32) -> f32 {
    ((hit * rec) * pf) * (1.0 + rec * c)
}
