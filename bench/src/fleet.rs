//! Routing quality on a Mooncake-format trace (issue #44, part 2): a fleet of simulated engines
//! replays the trace in simulated time under a routing policy.
//!
//! Engine model (per engine, first come first served): a bounded batch of `batch` requests; a
//! request waits for a batch slot, then for the engine's prefill unit (prefills run one at a
//! time), prefills its uncached tokens at `prefill_ms_per_token`, then decodes its output at
//! `decode_ms_per_token` while holding its slot. TTFT = admission to end of prefill. The prefix
//! KV cache is an LRU of `capacity` blocks of 512 tokens ([`LruCache`], the same one as the index
//! replay, prefix-closed); a request's blocks are cached when it is admitted (they are resident
//! from then on) and its hit is the longest cached prefix at that moment.
//!
//! Policies pick an engine per request from what they may know: `random` and `round-robin`
//! nothing; `least-loaded` the outstanding requests; `dynamo-cost` the exact cached overlap and
//! the active blocks (Dynamo's documented cost: `overlap_weight × prefill blocks + decode
//! blocks`, lowest wins); `oracle` every cache and queue (it simulates the request on each
//! engine and takes the lowest TTFT); `inferencecache` only what the server answers
//! (`LookupRoute` on a running server binary, to which the engines report what a sidecar
//! would: stored blocks by `ReportCacheState`, evictions by `PublishEvent`, stats with the
//! pressure = outstanding / batch), falling back to least-loaded when the answer matches nothing.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::mooncake::{LruCache, TRACE_BLOCK_TOKENS, Trace, content_hash};
use crate::w1m::splitmix64;
use inferencecache_engine::fingerprint::next_prefix;

/// Engine service model.
#[derive(Debug, Clone, Copy)]
pub struct EngineModel {
    /// Prefill time per uncached prompt token (ms).
    pub prefill_ms_per_token: f64,
    /// Decode time per output token (ms).
    pub decode_ms_per_token: f64,
    /// Concurrent requests per engine.
    pub batch: usize,
}

impl Default for EngineModel {
    fn default() -> Self {
        Self {
            prefill_ms_per_token: 0.05,
            decode_ms_per_token: 20.0,
            batch: 32,
        }
    }
}

/// One simulated engine.
#[derive(Debug, Clone)]
pub struct Engine {
    /// Prefix cache.
    pub cache: LruCache,
    /// Decode end times (ms) of the requests holding a slot.
    slots: BinaryHeap<Reverse<u64>>,
    /// Blocks of each slot holder, parallel sum (active blocks).
    active: Vec<(u64, u64)>,
    /// When the prefill unit is next free (ms, fractional as µs in u64).
    prefill_free_us: u64,
    /// Busy time: prefill plus decode work (ms).
    pub busy_ms: f64,
    stamp: u64,
}

/// What admitting a request did.
#[derive(Debug, Clone, Default)]
pub struct Admission {
    /// Cached prefix blocks used.
    pub hit_blocks: usize,
    /// Prompt tokens not prefilled thanks to the cache.
    pub saved_tokens: u64,
    /// Time to first token (ms).
    pub ttft_ms: f64,
    /// Evicted sequence hashes (leaves first).
    pub evicted: Vec<u64>,
    /// Chain position of the first new block, and the new blocks.
    pub stored_from: usize,
    /// Number of new blocks stored.
    pub stored: usize,
}

impl Engine {
    /// An idle engine with an empty cache of `capacity` blocks.
    #[must_use]
    pub fn new(capacity: usize) -> Self {
        Self {
            cache: LruCache::new(capacity.max(1)),
            slots: BinaryHeap::new(),
            active: Vec::new(),
            prefill_free_us: 0,
            busy_ms: 0.0,
            stamp: 0,
        }
    }

    /// Frees the slots whose decode ended by `now_us`.
    pub fn advance(&mut self, now_us: u64) {
        while let Some(Reverse(end)) = self.slots.peek() {
            if *end > now_us {
                break;
            }
            self.slots.pop();
        }
        self.active.retain(|(end, _)| *end > now_us);
    }

    /// Outstanding requests (holding a slot).
    #[must_use]
    pub fn outstanding(&self) -> usize {
        self.slots.len()
    }

    /// Blocks of the outstanding requests.
    #[must_use]
    pub fn active_blocks(&self) -> u64 {
        self.active.iter().map(|(_, b)| *b).sum()
    }

    /// The TTFT (µs) a request would see here, without admitting it.
    #[must_use]
    pub fn predict_ttft_us(&self, now_us: u64, seq: &[u64], input: u64, m: &EngineModel) -> u64 {
        let hit = self.cache.prefix_len(seq).min(self.cache.capacity());
        let (slot_at, _) = self.slot_time(now_us, m);
        let start = slot_at.max(self.prefill_free_us);
        start + prefill_us(input, hit, m) - now_us
    }

    fn slot_time(&self, now_us: u64, m: &EngineModel) -> (u64, bool) {
        if self.slots.len() < m.batch {
            (now_us, false)
        } else {
            // FCFS: the earliest decode end frees the next slot.
            let earliest = self.slots.peek().map_or(now_us, |r| r.0);
            (earliest.max(now_us), true)
        }
    }

    /// Admits a request at `now_us`: cache lookup and update (LRU, leaf-first eviction), queue,
    /// prefill and decode times.
    pub fn admit(
        &mut self,
        now_us: u64,
        seq: &[u64],
        input: u64,
        output: u64,
        m: &EngineModel,
    ) -> Admission {
        let capacity = self.cache.capacity();
        let n = seq.len();
        let hit = self.cache.prefix_len(seq);
        let keep = n.min(capacity);
        let hit = hit.min(keep);
        let (slot_at, full) = self.slot_time(now_us, m);
        if full {
            self.slots.pop();
        }
        let start = slot_at.max(self.prefill_free_us);
        let prefill = prefill_us(input, hit, m);
        let end_prefill = start + prefill;
        self.prefill_free_us = end_prefill;
        let decode = (output as f64 * m.decode_ms_per_token * 1000.0) as u64;
        let end = end_prefill + decode;
        self.slots.push(Reverse(end));
        self.active.push((end, n as u64));
        self.busy_ms += (prefill + decode) as f64 / 1000.0;

        // Cache: touch the hit prefix, evict, store the rest; parents stay newer than children.
        for j in (0..hit).rev() {
            self.stamp += 1;
            self.cache.touch(seq[j], self.stamp);
        }
        let misses = keep - hit;
        let over = (self.cache.len() + misses).saturating_sub(capacity);
        let mut evicted = Vec::with_capacity(over);
        for _ in 0..over {
            if let Some(h) = self.cache.pop_lru() {
                evicted.push(h);
            }
        }
        for j in (hit..keep).rev() {
            self.stamp += 1;
            self.cache.touch(seq[j], self.stamp);
        }
        for j in (0..hit).rev() {
            self.stamp += 1;
            self.cache.touch(seq[j], self.stamp);
        }
        Admission {
            hit_blocks: hit,
            saved_tokens: saved_tokens(input, hit),
            ttft_ms: (end_prefill - now_us) as f64 / 1000.0,
            evicted,
            stored_from: hit,
            stored: misses,
        }
    }
}

/// Prompt tokens a cached prefix of `hit` blocks saves (at most the prompt).
#[must_use]
pub fn saved_tokens(input: u64, hit: usize) -> u64 {
    (hit as u64 * TRACE_BLOCK_TOKENS as u64).min(input)
}

fn prefill_us(input: u64, hit: usize, m: &EngineModel) -> u64 {
    let uncached = input - saved_tokens(input, hit);
    // At least one token is computed (the last one's logits).
    (uncached.max(1) as f64 * m.prefill_ms_per_token * 1000.0) as u64
}

/// The request's sequence hashes (copy 0 of [`content_hash`], rolled with [`next_prefix`]).
#[must_use]
pub fn sequence(hash_ids: &[u64]) -> Vec<u64> {
    let mut out = Vec::with_capacity(hash_ids.len());
    let mut prev = 0u64;
    for (j, id) in hash_ids.iter().enumerate() {
        let local = content_hash(0, *id);
        prev = if j == 0 {
            local
        } else {
            next_prefix(prev, local)
        };
        out.push(prev);
    }
    out
}

/// A routing policy.
pub trait Policy {
    /// Row name.
    fn name(&self) -> String;
    /// Picks an engine for request `r` (sequence `seq`) at `now_us`; the engines are advanced
    /// to `now_us`.
    fn choose(
        &mut self,
        r: usize,
        now_us: u64,
        seq: &[u64],
        input: u64,
        engines: &[Engine],
        m: &EngineModel,
    ) -> Result<usize, String>;
    /// Told what the chosen engine did (the server policy reports it).
    fn admitted(
        &mut self,
        _engine: usize,
        _seq: &[u64],
        _a: &Admission,
        _engines: &[Engine],
        _m: &EngineModel,
    ) -> Result<(), String> {
        Ok(())
    }
}

/// Uniform random choice (seeded).
pub struct Random(pub u64);
impl Policy for Random {
    fn name(&self) -> String {
        "random".into()
    }
    fn choose(
        &mut self,
        r: usize,
        _: u64,
        _: &[u64],
        _: u64,
        e: &[Engine],
        _: &EngineModel,
    ) -> Result<usize, String> {
        Ok((splitmix64(self.0 ^ r as u64) % e.len() as u64) as usize)
    }
}

/// Round robin.
pub struct RoundRobin;
impl Policy for RoundRobin {
    fn name(&self) -> String {
        "round-robin".into()
    }
    fn choose(
        &mut self,
        r: usize,
        _: u64,
        _: &[u64],
        _: u64,
        e: &[Engine],
        _: &EngineModel,
    ) -> Result<usize, String> {
        Ok(r % e.len())
    }
}

/// Fewest outstanding requests (lowest index on ties).
#[must_use]
pub fn least_loaded(engines: &[Engine]) -> usize {
    (0..engines.len())
        .min_by_key(|&i| (engines[i].outstanding(), engines[i].active_blocks(), i))
        .unwrap_or(0)
}

/// Fewest outstanding requests.
pub struct LeastLoaded;
impl Policy for LeastLoaded {
    fn name(&self) -> String {
        "least-loaded".into()
    }
    fn choose(
        &mut self,
        _: usize,
        _: u64,
        _: &[u64],
        _: u64,
        e: &[Engine],
        _: &EngineModel,
    ) -> Result<usize, String> {
        Ok(least_loaded(e))
    }
}

/// Dynamo's KV router cost: `overlap_weight × (request blocks − cached overlap) + active
/// blocks`, lowest wins (ties: lowest index).
pub struct DynamoCost {
    /// `overlap_score_weight` (Dynamo's default 1.0).
    pub overlap_weight: f64,
}
impl Policy for DynamoCost {
    fn name(&self) -> String {
        if self.overlap_weight == 1.0 {
            "dynamo-cost".into()
        } else {
            format!("dynamo-cost (weight {})", self.overlap_weight)
        }
    }
    fn choose(
        &mut self,
        _: usize,
        _: u64,
        seq: &[u64],
        _: u64,
        e: &[Engine],
        _: &EngineModel,
    ) -> Result<usize, String> {
        let cost = |i: usize| {
            let prefill = (seq.len() - e[i].cache.prefix_len(seq)) as f64;
            self.overlap_weight * prefill + e[i].active_blocks() as f64
        };
        Ok((0..e.len())
            .min_by(|a, b| cost(*a).total_cmp(&cost(*b)).then(a.cmp(b)))
            .unwrap_or(0))
    }
}

/// Knows every cache and queue: the lowest predicted TTFT (ties: longest cached prefix, then
/// lowest index).
pub struct Oracle;
impl Policy for Oracle {
    fn name(&self) -> String {
        "oracle".into()
    }
    fn choose(
        &mut self,
        _: usize,
        now: u64,
        seq: &[u64],
        input: u64,
        e: &[Engine],
        m: &EngineModel,
    ) -> Result<usize, String> {
        Ok((0..e.len())
            .min_by_key(|&i| {
                (
                    e[i].predict_ttft_us(now, seq, input, m),
                    Reverse(e[i].cache.prefix_len(seq)),
                    i,
                )
            })
            .unwrap_or(0))
    }
}

/// One policy's results at one cache size.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Policy.
    pub policy: String,
    /// Prompt tokens saved by the cache.
    pub saved_tokens: u64,
    /// Prompt tokens in all.
    pub input_tokens: u64,
    /// Cached blocks used / prompt blocks.
    pub hit_rate: f64,
    /// TTFT of every request (ms), sorted.
    pub ttft_ms: Vec<f64>,
    /// Max / mean busy time over the engines.
    pub imbalance: f64,
}

impl Outcome {
    /// TTFT quantile (nearest rank).
    #[must_use]
    pub fn ttft(&self, q: f64) -> f64 {
        if self.ttft_ms.is_empty() {
            return 0.0;
        }
        let rank = (q * self.ttft_ms.len() as f64).ceil() as usize;
        self.ttft_ms[rank.clamp(1, self.ttft_ms.len()) - 1]
    }
}

/// Replays `trace` on `engines` fresh engines of `capacity` blocks under `policy`.
pub fn simulate(
    trace: &Trace,
    engines: usize,
    capacity: usize,
    m: &EngineModel,
    policy: &mut dyn Policy,
) -> Result<Outcome, String> {
    let mut fleet: Vec<Engine> = (0..engines.max(1)).map(|_| Engine::new(capacity)).collect();
    let mut out = Outcome {
        policy: policy.name(),
        ..Outcome::default()
    };
    let (mut hit_blocks, mut blocks) = (0u64, 0u64);
    for (r, req) in trace.requests.iter().enumerate() {
        let now = req.timestamp_ms * 1000;
        for e in &mut fleet {
            e.advance(now);
        }
        let seq = sequence(&req.hash_ids);
        let chosen = policy.choose(r, now, &seq, req.input_length, &fleet, m)?;
        let chosen = chosen.min(fleet.len() - 1);
        let a = fleet[chosen].admit(now, &seq, req.input_length, req.output_length, m);
        policy.admitted(chosen, &seq, &a, &fleet, m)?;
        hit_blocks += a.hit_blocks as u64;
        blocks += seq.len() as u64;
        out.saved_tokens += a.saved_tokens;
        out.input_tokens += req.input_length;
        out.ttft_ms.push(a.ttft_ms);
    }
    out.ttft_ms.sort_by(f64::total_cmp);
    out.hit_rate = hit_blocks as f64 / blocks.max(1) as f64;
    let busy: Vec<f64> = fleet.iter().map(|e| e.busy_ms).collect();
    let mean = busy.iter().sum::<f64>() / busy.len() as f64;
    out.imbalance = busy.iter().copied().fold(0.0, f64::max) / mean.max(1e-9);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> EngineModel {
        EngineModel {
            prefill_ms_per_token: 0.1,
            decode_ms_per_token: 10.0,
            batch: 2,
        }
    }

    #[test]
    fn engine_queue_prefill_and_cache() {
        let m = model();
        let mut e = Engine::new(4);
        let a = sequence(&[1, 2, 3]);
        // 1500 tokens, nothing cached: prefill 150 ms; decode 10 tokens = 100 ms.
        let first = e.admit(0, &a, 1500, 10, &m);
        assert_eq!(first.hit_blocks, 0);
        assert_eq!(first.ttft_ms, 150.0);
        assert_eq!(first.stored, 3);
        // Same prefix at t = 10 ms: 3 blocks cached = 1536 ≥ 1500 tokens, one token computed,
        // but the prefill unit is busy until 150 ms.
        e.advance(10_000);
        let second = e.admit(10_000, &a, 1500, 10, &m);
        assert_eq!(second.hit_blocks, 3);
        assert_eq!(second.saved_tokens, 1500);
        assert!((second.ttft_ms - 140.1).abs() < 1e-9, "{}", second.ttft_ms);
        // Batch of 2 full: a third request waits for the first decode end (250 ms).
        e.advance(20_000);
        assert_eq!(e.outstanding(), 2);
        let b = sequence(&[9, 8]);
        let predicted = e.predict_ttft_us(20_000, &b, 1000, &m);
        let third = e.admit(20_000, &b, 1000, 1, &m);
        assert_eq!(predicted as f64 / 1000.0, third.ttft_ms);
        assert!(
            (third.ttft_ms - (250.0 - 20.0 + 100.0)).abs() < 1e-9,
            "{}",
            third.ttft_ms
        );
        // Capacity 4: storing 2 new blocks evicts the leaf-most LRU blocks of [1, 2, 3].
        assert_eq!(third.evicted, vec![a[2]]);
        assert!(e.cache.contains(a[0]) && e.cache.contains(a[1]));
        assert_eq!(e.cache.len(), 4);
    }

    #[test]
    fn oracle_beats_random_on_shared_prefixes() {
        let mut requests = Vec::new();
        for i in 0..200u64 {
            requests.push(crate::mooncake::Request {
                timestamp_ms: i * 50,
                input_length: 4096,
                output_length: 20,
                hash_ids: (0..8)
                    .map(|j| {
                        if j < 6 {
                            (i % 5) * 100 + j
                        } else {
                            10_000 + i * 8 + j
                        }
                    })
                    .collect(),
            });
        }
        let trace = Trace { requests };
        let m = model();
        let oracle = simulate(&trace, 4, 64, &m, &mut Oracle).expect("sim");
        let random = simulate(&trace, 4, 64, &m, &mut Random(1)).expect("sim");
        assert!(oracle.saved_tokens > random.saved_tokens);
        assert!(oracle.ttft(0.99) <= random.ttft(0.99));
        assert_eq!(oracle.ttft_ms.len(), 200);
    }
}
