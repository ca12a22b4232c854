//! One replica's entry state as runs store it ([`Holder`]), the tier and timestamp codes it
//! packs, and the digest that names a key.
//!
//! [`Holder`] packs `last_seen` (ms, signed 43 bits: years ~1830–2109; out-of-range timestamps
//! are clamped), the replica index (20 bits), `token_count` (i32), the tier code (2 bits) and a
//! per-entry generation (27 bits, from a per-partition counter; it wraps after 2^27 creations in
//! one partition, far longer than any captured hit lives).

/// Tier codes as stored (K6 compaction): 1 = T1, 2 = T2, 3 = T3, 4 = colder/invalid.
pub(crate) const TIER_COLDER: u8 = 4;
/// Largest scope-local replica index.
pub(crate) const REP_MASK: u32 = (1 << REP_BITS) - 1;
const REP_BITS: u32 = 20;
/// Stored `last_seen` bits (signed).
const TS_BITS: u32 = 43;
const TS_MAX: i64 = (1 << (TS_BITS - 1)) - 1;
const TS_MIN: i64 = -(1 << (TS_BITS - 1));
/// Per-entry generations are 27-bit.
pub(crate) const GEN_MASK: u32 = (1 << 27) - 1;

/// Wire → stored tier (K6).
#[inline]
pub(crate) fn tier_code(wire: i32) -> u8 {
    match wire {
        0 => 1,
        1..=3 => wire as u8,
        _ => TIER_COLDER,
    }
}

/// Stored → wire tier (K6).
#[inline]
pub(crate) fn tier_wire(code: u8) -> i32 {
    if (1..=3).contains(&code) {
        code as i32
    } else {
        0
    }
}

/// Clamps a ms timestamp to the 43-bit stored range (years ~1830–2109).
#[inline]
pub(crate) fn clamp_ts(ms: i64) -> i64 {
    ms.clamp(TS_MIN, TS_MAX)
}

/// One holder of a key (16 bytes).
///
/// `a = last_seen_ms (signed 43, sign-extended to 44 bits) << 20 | rep (20)`;
/// `b = tokens (u32) | tier−1 (2) << 32 | generation (27) << 34` (bits 61–63 clear).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Holder {
    a: u64,
    b: u64,
}

impl Holder {
    /// A holder entry: replica index `rep` (≤ 2^20 − 1), tier code 1..=4, token count,
    /// `last_seen` (ms, clamped to 43 bits) and generation (27 bits).
    #[inline]
    pub fn new(rep: u32, tier: u8, tokens: i32, last_seen_ms: i64, generation: u32) -> Self {
        debug_assert!(rep <= REP_MASK);
        debug_assert!((1..=4).contains(&tier));
        let a = ((clamp_ts(last_seen_ms) as u64) << REP_BITS) | rep as u64;
        let b = (tokens as u32 as u64)
            | (((tier - 1) as u64 & 3) << 32)
            | (((generation & GEN_MASK) as u64) << 34);
        Self { a, b }
    }
    /// A holder from its two stored words (a run's holder entry, `raw::block_run`).
    #[inline]
    pub fn from_words(a: u64, b: u64) -> Self {
        Self { a, b }
    }
    /// The two stored words.
    #[inline]
    pub fn words(&self) -> (u64, u64) {
        (self.a, self.b)
    }
    /// The replica's index in its scope.
    #[inline]
    pub fn rep(&self) -> u32 {
        (self.a & REP_MASK as u64) as u32
    }
    /// When the replica last reported the block (ms since the epoch).
    #[inline]
    pub fn last_seen_ms(&self) -> i64 {
        (self.a as i64) >> REP_BITS
    }
    /// The block's token count (K8).
    #[inline]
    pub fn tokens(&self) -> i32 {
        self.b as u32 as i32
    }
    /// This holder with its token count replaced.
    #[inline]
    pub fn with_tokens(&self, tokens: i32) -> Self {
        Self {
            a: self.a,
            b: (self.b & !u64::from(u32::MAX)) | u64::from(tokens as u32),
        }
    }
    /// The tier code (1..=4).
    #[inline]
    pub fn tier(&self) -> u8 {
        ((self.b >> 32) & 3) as u8 + 1
    }
    /// The entry's generation: a re-created entry of the same key and replica has another.
    #[inline]
    pub fn generation(&self) -> u32 {
        ((self.b >> 34) as u32) & GEN_MASK
    }
    /// K11 refresh: new tokens and tier, `last_seen = max(old, ts)` (D7); generation kept.
    #[inline]
    pub(crate) fn refreshed(&self, tokens: i32, tier: u8, ts_ms: i64) -> Self {
        let ls = self.last_seen_ms().max(clamp_ts(ts_ms));
        Self::new(self.rep(), tier, tokens, ls, self.generation())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_holder_packs_its_fields() {
        let h = Holder::new(REP_MASK, 4, -2, -5, GEN_MASK);
        assert_eq!(
            (
                h.rep(),
                h.tier(),
                h.tokens(),
                h.last_seen_ms(),
                h.generation()
            ),
            (REP_MASK, 4, -2, -5, GEN_MASK)
        );
        let h = h.with_tokens(i32::MAX);
        assert_eq!(
            (h.tokens(), h.tier(), h.generation()),
            (i32::MAX, 4, GEN_MASK)
        );
        assert_eq!(clamp_ts(i64::MAX), TS_MAX);
        assert_eq!(Holder::new(0, 1, 0, i64::MIN, 0).last_seen_ms(), TS_MIN);
        let r = h.refreshed(7, 2, -10);
        assert_eq!(
            (r.tokens(), r.tier(), r.last_seen_ms(), r.generation()),
            (7, 2, -5, GEN_MASK)
        );
    }

    #[test]
    fn tiers_map_as_k6_says() {
        assert_eq!([0, 1, 2, 3, 4, -1].map(tier_code), [1, 1, 2, 3, 4, 4]);
        assert_eq!([1, 2, 3, 4].map(tier_wire), [1, 2, 3, 0]);
    }
}
