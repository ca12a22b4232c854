//! The W1M workload, bit for bit (`benchmarks.md` §2.1).
//!
//! All arithmetic is wrapping `u64`. `seq` chains with the fingerprint's `next` function
//! ([`inferencecache_engine::fingerprint::next_prefix`], XXH3-64 seed 1337 over
//! `le_u64(prev) ‖ le_u64(content)`), which equals `kv_index::chain_prefix_hash`.
//!
//! Queries are generated in one pass, in the order the spec states: for each iteration one Q50
//! (xorshift draw, then 32 `fresh()` values), one Q100 (xorshift draw) and one Q0 (64 `fresh()`
//! values), with `fresh()`'s counter shared by Q50 and Q0. Generating fewer iterations yields
//! exactly the first queries of the full 100,000.

use inferencecache_engine::fingerprint::{next_prefix, to_wire};

/// Blocks per chain.
pub const LEN: usize = 64;
/// Workers (replicas) `w0..w7`.
pub const WORKERS: usize = 8;
/// W1M's chain count.
pub const CHAINS_FULL: usize = 16_384;
/// The fan-out variant's chain count (1,500 root children).
pub const CHAINS_FANOUT: usize = 12_000;
/// CI smoke scale (1/16).
pub const CHAINS_SMOKE: usize = 1_024;
/// Query iterations of a full run.
pub const QUERIES: usize = 100_000;
/// Warm-up queries of a full run.
pub const WARMUP: usize = 10_000;
/// Timed rounds of a full run.
pub const ROUNDS: usize = 3;
/// Tokens per block (InferenceCache counts are `[16; 64]`).
pub const BLOCK_TOKENS: i32 = 16;
/// Seed of the query xorshift.
pub const RNG_SEED: u64 = 42;

/// One chain or query: 64 block values.
pub type Chain = [u64; LEN];
/// One chain in wire form: 64 keys of 8 big-endian bytes.
pub type WireChain = [[u8; 8]; LEN];

/// `splitmix64` as the spec writes it (one step on the given state).
#[inline]
#[must_use]
pub const fn splitmix64(x: u64) -> u64 {
    let x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The worker holding chain `c`.
#[inline]
#[must_use]
pub const fn worker(c: usize) -> usize {
    c % WORKERS
}

/// The per-block content hash `local(c, pos)`.
#[inline]
#[must_use]
pub const fn local(c: u64, pos: u64) -> u64 {
    let (level, owner) = if pos < 16 {
        (1u64, c / 8)
    } else if pos < 32 {
        (2u64, c / 2)
    } else {
        (3u64, c)
    };
    splitmix64((level << 56) ^ (owner << 8) ^ pos)
}

/// `local(c, 0..64)`.
#[must_use]
pub fn local_chain(c: usize) -> Chain {
    let mut out = [0u64; LEN];
    for (pos, v) in out.iter_mut().enumerate() {
        *v = local(c as u64, pos as u64);
    }
    out
}

/// Rolling prefix hashes of a list of content values: `q[0] = v[0]`,
/// `q[i] = next(q[i-1], v[i])`. Applied to `local_chain(c)` it gives `seq(c)`.
#[must_use]
pub fn rolling(values: &Chain) -> Chain {
    let mut out = [0u64; LEN];
    let mut prev = values[0];
    out[0] = prev;
    for i in 1..LEN {
        prev = next_prefix(prev, values[i]);
        out[i] = prev;
    }
    out
}

/// `seq(c)`.
#[must_use]
pub fn seq_chain(c: usize) -> Chain {
    rolling(&local_chain(c))
}

/// Wire form (8 bytes big-endian per value) of a chain.
#[must_use]
pub fn wire(values: &Chain) -> WireChain {
    let mut out = [[0u8; 8]; LEN];
    for (o, v) in out.iter_mut().zip(values) {
        *o = to_wire(*v);
    }
    out
}

/// Parses a `--chains` value of the W1M binaries: at least one chain per worker group (8).
///
/// # Errors
/// A message naming the flag when `v` is not a number ≥ 8.
pub fn parse_chains(v: &str) -> Result<usize, String> {
    v.parse::<usize>()
        .ok()
        .filter(|&n| n >= WORKERS)
        .ok_or_else(|| "--chains needs a number ≥ 8".into())
}

/// The stored side of W1M: `local` and `seq` of every chain.
pub struct Workload {
    /// Number of chains.
    pub chains: usize,
    /// `local(c, 0..64)` per chain.
    pub local: Vec<Chain>,
    /// `seq(c)` per chain.
    pub seq: Vec<Chain>,
}

impl Workload {
    /// Generates `chains` chains (16,384 for W1M).
    #[must_use]
    pub fn new(chains: usize) -> Self {
        let local: Vec<Chain> = (0..chains).map(local_chain).collect();
        let seq: Vec<Chain> = local.iter().map(rolling).collect();
        Self { chains, local, seq }
    }

    /// Storage entries after insert: one per (worker, block).
    #[must_use]
    pub fn entries(&self) -> usize {
        self.chains * LEN
    }

    /// The insert events in wire form (InferenceCache keys), chain order.
    #[must_use]
    pub fn wire_events(&self) -> Vec<WireChain> {
        self.seq.iter().map(wire).collect()
    }
}

/// The query xorshift64 (`rng = 42`).
#[derive(Debug, Clone)]
pub struct Xorshift64(pub u64);

impl Default for Xorshift64 {
    fn default() -> Self {
        Self(RNG_SEED)
    }
}

impl Xorshift64 {
    /// `rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng`.
    #[inline]
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

/// The shared `fresh()` counter: `k += 1; splitmix64((7 << 56) ^ k)`.
#[derive(Debug, Clone, Default)]
pub struct Fresh(pub u64);

impl Fresh {
    /// The next fresh (never stored) content value.
    #[inline]
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 += 1;
        splitmix64((7u64 << 56) ^ self.0)
    }
}

/// Query set kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// First 32 blocks of a stored chain, then 32 fresh.
    Q50,
    /// A whole stored chain.
    Q100,
    /// 64 fresh blocks.
    Q0,
}

impl Kind {
    /// All three, in generation order.
    pub const ALL: [Kind; 3] = [Kind::Q50, Kind::Q100, Kind::Q0];

    /// Lower-case label (`q50`, `q100`, `q0`).
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            Kind::Q50 => "q50",
            Kind::Q100 => "q100",
            Kind::Q0 => "q0",
        }
    }

    /// Expected Σ matched blocks per query over the 8 workers (§2.4).
    #[must_use]
    pub fn blocks_per_query(self) -> u64 {
        match self {
            Kind::Q50 => 160,
            Kind::Q100 => 192,
            Kind::Q0 => 0,
        }
    }

    /// Expected Σ matched tokens per query (InferenceCache, 16 tokens per block).
    #[must_use]
    pub fn tokens_per_query(self) -> u64 {
        self.blocks_per_query() * BLOCK_TOKENS as u64
    }

    /// Workers with a non-empty match per query.
    #[must_use]
    pub fn replicas_per_query(self) -> u64 {
        match self {
            Kind::Q0 => 0,
            _ => WORKERS as u64,
        }
    }

    /// Expected full-LookupRoute score sum per query (§2.4).
    #[must_use]
    pub fn score_sum_per_query(self) -> f64 {
        match self {
            Kind::Q50 => 768.0,
            Kind::Q100 => 1280.0,
            Kind::Q0 => 0.0,
        }
    }
}

/// Expected matched blocks of worker `w` for a query of `kind` built from chain `c` (§2.4).
#[must_use]
pub fn expected_blocks(kind: Kind, c: usize, w: usize) -> u32 {
    let owner = worker(c);
    match kind {
        Kind::Q0 => 0,
        Kind::Q50 => {
            if w == owner || w == owner ^ 1 {
                32
            } else {
                16
            }
        }
        Kind::Q100 => {
            if w == owner {
                64
            } else if w == owner ^ 1 {
                32
            } else {
                16
            }
        }
    }
}

/// One query set: the content lists (`local` values / fresh values) and the chain each came from.
pub struct QuerySet {
    /// Kind.
    pub kind: Kind,
    /// Content values per query (what Dynamo and kv-index consume).
    pub blocks: Vec<Chain>,
    /// Source chain per query (`usize::MAX` for Q0).
    pub chain: Vec<usize>,
}

impl QuerySet {
    /// Number of queries.
    #[must_use]
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether the set is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The queries as a gateway would send them to InferenceCache: rolling hashes, wire form.
    #[must_use]
    pub fn wire_rolling(&self) -> Vec<WireChain> {
        self.blocks.iter().map(|q| wire(&rolling(q))).collect()
    }
}

/// The three query sets.
pub struct Queries {
    /// Q50.
    pub q50: QuerySet,
    /// Q100.
    pub q100: QuerySet,
    /// Q0.
    pub q0: QuerySet,
}

impl Queries {
    /// Generates `iterations` iterations over a workload of `chains` chains (100,000 for W1M).
    #[must_use]
    pub fn generate(chains: usize, iterations: usize) -> Self {
        let mut rng = Xorshift64::default();
        let mut fresh = Fresh::default();
        let mut q50 = QuerySet {
            kind: Kind::Q50,
            blocks: Vec::with_capacity(iterations),
            chain: Vec::with_capacity(iterations),
        };
        let mut q100 = QuerySet {
            kind: Kind::Q100,
            blocks: Vec::with_capacity(iterations),
            chain: Vec::with_capacity(iterations),
        };
        let mut q0 = QuerySet {
            kind: Kind::Q0,
            blocks: Vec::with_capacity(iterations),
            chain: Vec::with_capacity(iterations),
        };
        for _ in 0..iterations {
            let c = (rng.next() % chains as u64) as usize;
            let mut q = [0u64; LEN];
            for (pos, v) in q.iter_mut().enumerate().take(32) {
                *v = local(c as u64, pos as u64);
            }
            for v in q.iter_mut().skip(32) {
                *v = fresh.next();
            }
            q50.blocks.push(q);
            q50.chain.push(c);

            let c = (rng.next() % chains as u64) as usize;
            q100.blocks.push(local_chain(c));
            q100.chain.push(c);

            let mut q = [0u64; LEN];
            for v in q.iter_mut() {
                *v = fresh.next();
            }
            q0.blocks.push(q);
            q0.chain.push(usize::MAX);
        }
        Self { q50, q100, q0 }
    }

    /// The set of a kind.
    #[must_use]
    pub fn set(&self, kind: Kind) -> &QuerySet {
        match kind {
            Kind::Q50 => &self.q50,
            Kind::Q100 => &self.q100,
            Kind::Q0 => &self.q0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn check_values_local_and_seq() {
        assert_eq!(local(0, 0), 0xc9ed_9924_11bb_b661);
        assert_eq!(local(16383, 63), 0x0c83_8a58_7706_bce1);
        let s0 = seq_chain(0);
        assert_eq!(s0[0], local(0, 0));
        assert_eq!(s0[1], 0xcaa9_5053_fb45_5cd2);
        assert_eq!(s0[63], 0x8dd8_1ce1_3234_6b03);
        assert_eq!(seq_chain(16383)[63], 0x368a_5f8f_2359_7535);
    }

    #[test]
    fn check_values_rng_and_fresh() {
        let mut rng = Xorshift64::default();
        let a = rng.next();
        assert_eq!(a, 45_454_805_674);
        assert_eq!(a % CHAINS_FULL as u64, 2730);
        let b = rng.next();
        assert_eq!(b, 11_532_217_803_599_905_471);
        assert_eq!(b % CHAINS_FULL as u64, 703);
        let mut f = Fresh::default();
        assert_eq!(f.next(), 0xa701_57d4_11df_fd4d);
    }

    #[test]
    fn check_values_generated_queries() {
        let q = Queries::generate(CHAINS_FULL, 3);
        assert_eq!(q.q50.chain[0], 2730);
        assert_eq!(q.q100.chain[0], 703);
        assert_eq!(q.q50.blocks[0][32], 0xa701_57d4_11df_fd4d);
        // Fresh counter shared in generation order: Q50#0 takes 1..=32, Q0#0 takes 33..=96.
        let mut f = Fresh::default();
        for _ in 0..32 {
            f.next();
        }
        assert_eq!(q.q0.blocks[0][0], f.next());
        // Q50's rolling wire form starts with seq(c)[0..32].
        let s = seq_chain(2730);
        let r = rolling(&q.q50.blocks[0]);
        assert_eq!(r[..32], s[..32]);
        assert_ne!(r[32], s[32]);
        assert_eq!(wire(&r)[0], s[0].to_be_bytes());
        // Fewer iterations are a prefix of more.
        let q2 = Queries::generate(CHAINS_FULL, 5);
        assert_eq!(q2.q0.blocks[2], q.q0.blocks[2]);
        assert_eq!(q2.q100.chain[2], q.q100.chain[2]);
    }

    #[test]
    fn check_values_distinct_counts() {
        let w = Workload::new(CHAINS_FULL);
        assert_eq!(w.entries(), 1_048_576);
        let mut locals = HashSet::with_capacity(700_000);
        let mut seqs = HashSet::with_capacity(700_000);
        let mut roots = HashSet::new();
        for c in 0..w.chains {
            locals.extend(w.local[c].iter().copied());
            seqs.extend(w.seq[c].iter().copied());
            roots.insert(w.seq[c][0]);
        }
        assert_eq!(locals.len(), 688_128);
        assert_eq!(seqs.len(), 688_128);
        assert_eq!(roots.len(), 2_048);
        // Fan-out variant.
        let roots: HashSet<u64> = (0..CHAINS_FANOUT).map(|c| local(c as u64, 0)).collect();
        assert_eq!(roots.len(), 1_500);
    }

    #[test]
    fn expected_per_replica_sums() {
        for c in [0usize, 5, 2730, 16383] {
            for kind in Kind::ALL {
                let s: u64 = (0..WORKERS)
                    .map(|w| u64::from(expected_blocks(kind, c, w)))
                    .sum();
                assert_eq!(s, kind.blocks_per_query());
            }
        }
    }
}
