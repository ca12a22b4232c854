//! The core longest-prefix match (L4 steps 1–4): a software-pipelined walk of a request's
//! block hashes over one partition's key table (home groups prefetched, candidates taken
//! ahead, nodes resolved), stepping over the blocks of a chain run whose keys follow the
//! request's. Two paths give the same runs: a bitset path when every replica fresh at block 0
//! has a scope-local index below 64, and the general path.

use super::Index;
use super::records::Partition;
use super::resolution::PartitionHandle;
use super::route::Ranked;
use crate::clock::us_to_ms;
use crate::rank::{freshness, is_live};
use crate::raw::node::{KeyNode, tier_wire};
use crate::raw::table::{Candidate, KeyTable, Probe};
use crossbeam_epoch::{self as epoch, Guard};

/// One run of the core longest-prefix match (L4 steps 1–4).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChainMatch<'a> {
    /// Replica id.
    pub replica_id: &'a str,
    /// Σ of the request's counts over the run.
    pub matched_tokens: i32,
    /// Oldest `last_seen` over the run (µs, ms resolution).
    pub oldest_us: i64,
    /// Coldest tier over the run (wire value).
    pub tier: i32,
    /// Blocks in the run.
    pub blocks: u32,
}

#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Run {
    pub(super) rep: u32,
    pub(super) matched: i32,
    pub(super) oldest: i64,
    pub(super) tier: u8,
    pub(super) blocks: u32,
    pub(super) open: bool,
}

/// Reusable scratch space for [`Index::match_chain_into`].
#[derive(Default)]
pub struct MatchScratch {
    pub(super) runs: Vec<Run>,
    pub(super) ranked: Vec<Ranked>,
    pub(super) nodes: Vec<usize>,
    /// Per-replica run state of the bitset fast path (indices < 64), sized 64 once.
    fast: Vec<Run>,
}

/// How many blocks after block `i` of the request the chain run named by `node` covers:
/// blocks whose keys continue the run's and that still carry exactly `node`'s holders (see
/// [`crate::raw::runs`]); 0 if `node` names no run. Also whether the skip reached the run's last
/// block: the request then goes on past the ingested chain, block by block unless it meets
/// another run (its prefetch pipeline is primed at once). A skip that ends inside the run lands
/// on a block whose holders changed, usually the start of the run's next stretch, or where the
/// request left the chain.
#[inline]
fn walk_skip<H: AsRef<[u8]>>(node: &KeyNode, hashes: &[H], i: usize, n: usize) -> (usize, bool) {
    let Some((r, o)) = node.run() else {
        return (0, false);
    };
    // SAFETY: `node` is reachable under the caller's guard and names the run, so the run is
    // freed (if at all) only after that guard is dropped (`runs`, "Reclamation").
    let r = unsafe { &*r };
    let max = (r.stretch_end(o) - o - 1).min(n - i - 1);
    let req = &hashes[i + 1..i + 1 + max];
    // Byte-wise equality as native words (no byte swaps), four keys per branch: the compares of
    // a long stretch (W1M Q100: 15 + 15 + 31) are independent, only their combined verdict is
    // tested.
    let word = |h: &H| <[u8; 8]>::try_from(h.as_ref()).ok().map(u64::from_ne_bytes);
    let at = |m: usize| u64::from_ne_bytes(*r.key_bytes(o + 1 + m));
    let mut m = 0;
    while m + 4 <= max {
        let mut diff = 0u64;
        let mut long = false;
        for (t, h) in req[m..m + 4].iter().enumerate() {
            match word(h) {
                Some(w) => diff |= w ^ at(m + t),
                None => long = true,
            }
        }
        if diff != 0 || long {
            break;
        }
        m += 4;
    }
    while m < max && word(&req[m]) == Some(at(m)) {
        m += 1;
    }
    (m, m > 0 && o + 1 + m == r.len())
}

/// Chain walk: home groups are prefetched this many blocks ahead.
pub(super) const PREFETCH: usize = 8;
/// Chain walk: candidates (home group read, node prefetched) are taken this many blocks ahead
/// (≤ 7: ring of 8).
const AHEAD: usize = 4;

/// Chain walk: probes kept ahead of the block being resolved (a power of two > PREFETCH).
const PROBES: usize = 16;

/// What one chain walk reads and never changes: the partition's table, the request (its
/// hashes and counts, `n` blocks of both), the clock and TTL that decide liveness, the guard
/// every node read is made under, and whether the walk records each visited node (which also
/// turns run skips off: every block is visited).
struct Walk<'w, 'k, H> {
    table: &'w KeyTable,
    hashes: &'k [H],
    counts: &'w [i32],
    /// Blocks to walk at most: `min(hashes.len(), counts.len())`, > 0.
    n: usize,
    now_ms: i64,
    ttl_ms: i64,
    guard: &'w Guard,
    capture_nodes: bool,
}

/// Where a chain walk starts, as `walk_chain` found it: block 0's node, the blocks after it a
/// chain run covers (see `walk_skip`), and whether the prefetch pipeline already runs ahead
/// (see `land_after_skip`).
struct FirstBlock<'w> {
    node: &'w KeyNode,
    skip: usize,
    primed: bool,
}

impl Index {
    /// L4 steps 1–4: the longest common leading run of every replica fresh at block 0. Leaves
    /// the closed runs in `scratch.runs`, sorted by replica index (and, with `capture_nodes`, the
    /// node of every visited block in `scratch.nodes`).
    ///
    /// Latency hiding: while block `i` is processed, the home group of block `i + PREFETCH` is
    /// prefetched and block `i + 1` is already probed and its node prefetched, so the dependent
    /// misses of consecutive blocks overlap.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn walk_chain<H: AsRef<[u8]>>(
        part: &Partition,
        hashes: &[H],
        counts: &[i32],
        now_ms: i64,
        ttl_ms: i64,
        guard: &Guard,
        scratch: &mut MatchScratch,
        capture_nodes: bool,
    ) {
        scratch.runs.clear();
        scratch.nodes.clear();
        let n = hashes.len().min(counts.len());
        if n == 0 || ttl_ms <= 0 {
            return;
        }
        let t = &part.table;
        let p0 = Probe::new(hashes[0].as_ref());
        t.prefetch_probe(p0, guard);
        let Some(n0) = t.find_p(p0, guard) else {
            return;
        };
        // Blocks after block 0 that a chain run covers (see `run_skip`): the pipeline starts
        // after them.
        let (skip0, tail0) = if capture_nodes {
            (0, false)
        } else {
            walk_skip(n0, hashes, 0, n)
        };
        // Each block's probe (digest and mixed hash) is computed once, when its home group is
        // prefetched, and reused by the candidate and resolve stages (`PROBES` blocks ahead).
        let mut probes = [p0; PROBES];
        let primed = if skip0 == 0 {
            Self::reprime(t, hashes, n, 1, guard, &mut probes);
            true
        } else {
            Self::land_after_skip(t, hashes, n, skip0 + 1, tail0, guard, &mut probes)
        };
        let walk = Walk {
            table: t,
            hashes,
            counts,
            n,
            now_ms,
            ttl_ms,
            guard,
            capture_nodes,
        };
        let first = FirstBlock {
            node: n0,
            skip: skip0,
            primed,
        };
        let hs0 = n0.holders();
        if hs0[hs0.len() - 1].rep() < 64 {
            Self::walk_fast(walk, first, scratch, &mut probes)
        } else {
            Self::walk_general(walk, first, scratch, &mut probes)
        }
    }

    /// Bitset path: every replica fresh at block 0 has a scope-local index < 64.
    #[inline]
    fn walk_fast<'k, H: AsRef<[u8]>>(
        walk: Walk<'_, 'k, H>,
        first: FirstBlock<'_>,
        scratch: &mut MatchScratch,
        probes: &mut [Probe<'k>; PROBES],
    ) {
        let Walk {
            table: t,
            hashes,
            counts,
            n,
            now_ms,
            ttl_ms,
            guard,
            capture_nodes,
        } = walk;
        let FirstBlock {
            node: n0,
            skip: skip0,
            primed: primed0,
        } = first;
        if scratch.fast.len() < 64 {
            scratch.fast.resize(64, Run::default());
        }
        let fr = &mut scratch.fast[..64];
        let mut open = 0u64;
        for h in n0.holders().iter() {
            let ls = h.last_seen_ms();
            if is_live(now_ms, ls, ttl_ms) {
                let r = h.rep();
                open |= 1 << r;
                fr[r as usize] = Run {
                    rep: r,
                    matched: 0,
                    oldest: ls,
                    tier: h.tier(),
                    blocks: 0,
                    open: true,
                };
            }
        }
        if open == 0 {
            return;
        }
        let started = open;
        if capture_nodes {
            scratch.nodes.push(n0 as *const KeyNode as usize);
        }
        // Σ counts[0..=i] (wrapping), i = last block of the runs still open.
        let mut acc = counts[0];
        // Pipeline: home groups are prefetched PREFETCH blocks ahead; the candidates of blocks
        // i+1 ..= i+AHEAD are read (and their nodes prefetched) before block i is processed.
        let cand_at = |j: usize, probes: &[Probe<'_>; PROBES]| -> Candidate {
            if j < n {
                t.candidate(probes[j % PROBES], guard)
            } else {
                Candidate::Miss
            }
        };
        // After a run skip the ring restarts with full probes (`Candidate::Probe`): the candidates'
        // group reads would stall on lines whose prefetch has only just been issued, and the
        // block after a skip often starts another run, which would skip them again.
        let mut ring = [Candidate::Probe; 8];
        let mut i = 1 + skip0;
        // Whether the prefetch pipeline runs ahead of block `i`. After a skip that ends inside
        // its run it does not: the block the walk lands on usually starts the run's next
        // stretch, and primed lines past it would be wasted (W1M Q50 lands on block 16, then
        // on the miss at 32); it is primed at the first landing block that takes no skip, or
        // at once where a tail likely follows (see `land_after_skip`).
        let mut primed = primed0;
        if skip0 == 0 {
            for (j, c) in ring.iter_mut().enumerate().take(AHEAD + 1).skip(1) {
                *c = cand_at(j, probes);
            }
        } else {
            for &c in &counts[1..=skip0] {
                acc = acc.wrapping_add(c);
            }
        }
        while i < n {
            let Some(node) = t.resolve(ring[i & 7], probes[i % PROBES], guard) else {
                break;
            };
            // A chain run decides first whether the next blocks need the pipeline at all.
            let (skip, tail) = if capture_nodes {
                (0, false)
            } else {
                walk_skip(node, hashes, i, n)
            };
            if skip == 0 {
                if primed {
                    if i + PREFETCH < n {
                        let p = Probe::new(hashes[i + PREFETCH].as_ref());
                        t.prefetch_home(p, guard);
                        probes[(i + PREFETCH) % PROBES] = p;
                    }
                    ring[(i + AHEAD) & 7] = cand_at(i + AHEAD, probes);
                } else {
                    // Full probes until the candidates catch up with the fresh prefetches.
                    Self::reprime(t, hashes, n, i + 1, guard, probes);
                    ring[(i + AHEAD) & 7] = Candidate::Probe;
                    primed = true;
                }
            }
            if capture_nodes {
                scratch.nodes.push(node as *const KeyNode as usize);
            }
            let mut still = 0u64;
            for h in node.holders().iter() {
                let r = h.rep();
                if r < 64 && open & (1 << r) != 0 {
                    let ls = h.last_seen_ms();
                    if is_live(now_ms, ls, ttl_ms) {
                        still |= 1 << r;
                        let run = &mut fr[r as usize];
                        run.oldest = run.oldest.min(ls);
                        run.tier = run.tier.max(h.tier());
                    }
                }
            }
            let mut closed = open & !still;
            while closed != 0 {
                let r = closed.trailing_zeros() as usize;
                closed &= closed - 1;
                fr[r].matched = acc;
                fr[r].blocks = i as u32;
            }
            open = still;
            if open == 0 {
                break;
            }
            // The blocks a chain run says carry these same holders: the open runs continue
            // through them unchanged (same liveness, oldest `last_seen` and tier).
            if skip > 0 {
                for &c in &counts[i..i + skip] {
                    acc = acc.wrapping_add(c);
                }
                i += skip;
                for j in i + 1..i + 1 + AHEAD {
                    ring[j & 7] = Candidate::Probe;
                }
                primed = Self::land_after_skip(t, hashes, n, i + 1, tail, guard, probes);
            }
            acc = acc.wrapping_add(counts[i]);
            i += 1;
        }
        // Field by field: copying a whole `Run` just after its fields were stored one by one
        // stalls on store forwarding (~14% of an in-cache Q50).
        let mut all = started;
        while all != 0 {
            let r = all.trailing_zeros() as usize;
            all &= all - 1;
            let f = &fr[r];
            let (matched, blocks) = if open & (1 << r) != 0 {
                (acc, i as u32)
            } else {
                (f.matched, f.blocks)
            };
            scratch.runs.push(Run {
                rep: r as u32,
                matched,
                oldest: f.oldest,
                tier: f.tier,
                blocks,
                open: false,
            });
        }
    }

    /// General path (any replica indices): merge the sorted open runs with each node's sorted
    /// holders.
    fn walk_general<'k, H: AsRef<[u8]>>(
        walk: Walk<'_, 'k, H>,
        first: FirstBlock<'_>,
        scratch: &mut MatchScratch,
        probes: &mut [Probe<'k>; PROBES],
    ) {
        let Walk {
            table: t,
            hashes,
            counts,
            n,
            now_ms,
            ttl_ms,
            guard,
            capture_nodes,
        } = walk;
        let FirstBlock {
            node: n0,
            skip: skip0,
            primed: primed0,
        } = first;
        let runs = &mut scratch.runs;
        for h in n0.holders().iter() {
            if is_live(now_ms, h.last_seen_ms(), ttl_ms) {
                runs.push(Run {
                    rep: h.rep(),
                    matched: counts[0],
                    oldest: h.last_seen_ms(),
                    tier: h.tier(),
                    blocks: 1,
                    open: true,
                });
            }
        }
        if runs.is_empty() {
            return;
        }
        if capture_nodes {
            scratch.nodes.push(n0 as *const KeyNode as usize);
        }
        let mut open = runs.len();
        // Steps over the `m` blocks a chain run covers after block `i` (see `run_skip`): every
        // open run continues through them.
        let advance = |i: usize, m: usize, runs: &mut Vec<Run>| {
            let mut sum = 0i32;
            for &c in &counts[i + 1..=i + m] {
                sum = sum.wrapping_add(c);
            }
            for r in runs.iter_mut().filter(|r| r.open) {
                r.matched = r.matched.wrapping_add(sum);
                r.blocks += m as u32;
            }
        };
        advance(0, skip0, runs);
        let mut i = 1 + skip0;
        // As in `walk_fast`: no prefetch pipeline past a block a run skip lands on inside
        // its run.
        let mut primed = primed0;
        while i < n {
            // Same probe ring as `walk_fast`: each block's probe is computed once, when its home
            // group is prefetched.
            if primed && i + PREFETCH < n {
                let p = Probe::new(hashes[i + PREFETCH].as_ref());
                t.prefetch_home(p, guard);
                probes[(i + PREFETCH) % PROBES] = p;
            }
            let Some(node) = t.find_p(probes[i % PROBES], guard) else {
                break;
            };
            if capture_nodes {
                scratch.nodes.push(node as *const KeyNode as usize);
            }
            let c = counts[i];
            // Runs and holders are both sorted by replica index: merge.
            let hs = node.holders();
            let mut j = 0usize;
            for r in runs.iter_mut() {
                if !r.open {
                    continue;
                }
                while j < hs.len() && hs[j].rep() < r.rep {
                    j += 1;
                }
                if j < hs.len()
                    && hs[j].rep() == r.rep
                    && is_live(now_ms, hs[j].last_seen_ms(), ttl_ms)
                {
                    let h = &hs[j];
                    r.matched = r.matched.wrapping_add(c);
                    r.oldest = r.oldest.min(h.last_seen_ms());
                    r.tier = r.tier.max(h.tier());
                    r.blocks += 1;
                } else {
                    r.open = false;
                    open -= 1;
                }
            }
            if open == 0 {
                break;
            }
            let (m, tail) = if capture_nodes {
                (0, false)
            } else {
                walk_skip(node, hashes, i, n)
            };
            if m > 0 {
                advance(i, m, runs);
                primed = Self::land_after_skip(t, hashes, n, i + m + 1, tail, guard, probes);
            } else if !primed {
                Self::reprime(t, hashes, n, i + 1, guard, probes);
                primed = true;
            }
            i += 1 + m;
        }
    }

    /// After a run skip: the probe of the block the walk lands on (`at`), its home group
    /// prefetched. When the skip reached its run's end (`tail`, see `walk_skip`) and the block
    /// may exist, the pipeline is primed from it at once (returns true): the request goes on
    /// past the chain the run covers. Otherwise it is primed only if that block takes no skip.
    #[inline]
    fn land_after_skip<'k, H: AsRef<[u8]>>(
        t: &KeyTable,
        hashes: &'k [H],
        n: usize,
        at: usize,
        tail: bool,
        guard: &Guard,
        probes: &mut [Probe<'k>; PROBES],
    ) -> bool {
        if at >= n {
            return false;
        }
        let p = Probe::new(hashes[at].as_ref());
        if tail && t.may_contain(p, guard) {
            Self::reprime(t, hashes, n, at, guard, probes);
            return true;
        }
        t.prefetch_probe(p, guard);
        probes[at % PROBES] = p;
        false
    }

    /// Starts the walk's probe pipeline at block `from` (block 1, or the first block after a run
    /// skip that takes none): the probes (and home-group prefetches) of blocks
    /// `from .. from + PREFETCH`.
    #[inline]
    fn reprime<'k, H: AsRef<[u8]>>(
        t: &KeyTable,
        hashes: &'k [H],
        n: usize,
        from: usize,
        guard: &Guard,
        probes: &mut [Probe<'k>; PROBES],
    ) {
        for (j, h) in hashes
            .iter()
            .enumerate()
            .take(n.min(from + PREFETCH))
            .skip(from)
        {
            let p = Probe::new(h.as_ref());
            t.prefetch_home(p, guard);
            probes[j % PROBES] = p;
        }
    }

    /// Core longest-common-leading-run match (L4 steps 1–5) on a resolved partition. Calls
    /// `sink` once per qualifying replica, in scope-local replica order. Allocates nothing once
    /// `scratch` has grown to the number of block-0 holders.
    pub fn match_chain_into<H: AsRef<[u8]>>(
        &self,
        part: PartitionHandle<'_>,
        hashes: &[H],
        counts: &[i32],
        now_us: i64,
        scratch: &mut MatchScratch,
        mut sink: impl FnMut(ChainMatch<'_>),
    ) {
        let p = part.p;
        let now_ms = us_to_ms(now_us);
        let ttl = self.ttl_for(&p.tenant.name);
        let guard = epoch::pin();
        Self::walk_chain(p, hashes, counts, now_ms, ttl, &guard, scratch, false);
        if scratch.runs.is_empty() {
            return;
        }
        let reps = p.scope.replicas.load(&guard);
        for r in scratch.runs.iter() {
            if r.matched <= 0 || freshness(now_ms, r.oldest, ttl) <= 0.0 {
                continue;
            }
            let Some(rr) = reps.get(r.rep as usize) else {
                continue;
            };
            sink(ChainMatch {
                replica_id: &rr.name,
                matched_tokens: r.matched,
                oldest_us: r.oldest * 1000,
                tier: tier_wire(r.tier),
                blocks: r.blocks,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::config::{DefaultResolvers, IndexConfig};
    use crate::index::testing::{NOW, chain};
    use std::sync::Arc;

    fn matches(ix: &Index, keys: &[[u8; 8]]) -> Vec<(String, i32, u32)> {
        let counts = vec![16i32; keys.len()];
        let p = ix.partition("t", "m", "s", "").unwrap();
        let mut v = Vec::new();
        let mut scratch = MatchScratch::default();
        ix.match_chain_into(p, keys, &counts, NOW, &mut scratch, |m| {
            v.push((m.replica_id.to_string(), m.matched_tokens, m.blocks))
        });
        v.sort();
        v
    }

    /// Replica r holds the first `1 + r % modulo` blocks of the chain.
    fn expected(reps: std::ops::Range<usize>, modulo: usize) -> Vec<(String, i32, u32)> {
        let mut v: Vec<_> = reps
            .map(|r| {
                (
                    format!("r{r:03}"),
                    16 * (1 + r % modulo) as i32,
                    (1 + r % modulo) as u32,
                )
            })
            .collect();
        v.sort();
        v
    }

    #[test]
    fn bitset_and_general_paths_agree() {
        // (chain length, replica r holds 1 + r % modulo blocks): the 40-block chain runs the
        // walks' probe rings (16 probes) around more than once.
        for (len, modulo) in [(12u64, 10usize), (40, 37)] {
            let keys: Vec<[u8; 8]> = (0..len).map(|i| (i * 7919 + 3).to_be_bytes()).collect();
            for nrep in [8usize, 63, 64, 70, 130] {
                let ix = Index::new(
                    IndexConfig::default(),
                    Arc::new(DefaultResolvers),
                    Arc::new(ManualClock::new(NOW)),
                );
                // Interleave ingest order so scope-local indices are not sorted by name.
                for r in (0..nrep).rev() {
                    chain(&ix, &format!("r{r:03}"), &keys[..1 + r % modulo]);
                }
                let want = expected(0..nrep, modulo);
                assert_eq!(matches(&ix, &keys), want, "len {len} nrep {nrep}");
                // Only replicas with index ≥ 64 left at block 0 → general path still exact.
                assert_eq!(
                    ix.storage_entries(),
                    (0..nrep).map(|r| 1 + r % modulo).sum::<usize>() as i64
                );
            }
        }
    }

    /// Both walk paths step over chain runs (every ingest after the first builds one over the
    /// blocks the others hold) and stop exactly where a replica's holder ends or was removed:
    /// 8 replicas take the bitset path, 70 the general one (block 0 has indices ≥ 64).
    #[test]
    fn both_walk_paths_step_over_runs_exactly() {
        let keys: Vec<[u8; 8]> = (0..40u64)
            .map(|i| (i * 104_729 + 11).to_be_bytes())
            .collect();
        for nrep in [8usize, 70] {
            let ix = Index::new(
                IndexConfig::default(),
                Arc::new(DefaultResolvers),
                Arc::new(ManualClock::new(NOW)),
            );
            // r005 holds 10 blocks; everyone else the whole chain, r005 ingesting last (its
            // run's stretch ends at block 10).
            for r in (0..nrep).filter(|&r| r != 5).chain([5]) {
                let n = if r == 5 { 10 } else { keys.len() };
                chain(&ix, &format!("r{r:03}"), &keys[..n]);
            }
            assert!(ix.memory_breakdown().chain_runs > 0, "runs were built");
            // r003 loses block 25 (a dead bit in the runs that cover it).
            ix.evict_prefixes("t", "m", "r003", "", &keys[25..26], 0);
            let want: Vec<(String, i32, u32)> = {
                let mut v: Vec<_> = (0..nrep)
                    .map(|r| {
                        let b = match r {
                            5 => 10,
                            3 => 25,
                            _ => keys.len() as u32,
                        };
                        (format!("r{r:03}"), 16 * b as i32, b)
                    })
                    .collect();
                v.sort();
                v
            };
            assert_eq!(matches(&ix, &keys), want, "nrep {nrep}");
            // A request that leaves the chain after block 30 stops there for everyone.
            let mut other = keys.clone();
            other[31] = 0xFFFF_FFFF_u64.to_be_bytes();
            let got = matches(&ix, &other);
            assert!(
                got.iter().all(|(r, _, b)| match r.as_str() {
                    "r005" => *b == 10,
                    "r003" => *b == 25,
                    _ => *b == 31,
                }),
                "nrep {nrep}: {got:?}"
            );
        }
    }

    /// The W1M staircase: runs over the shared levels, then a single-holder tail. The walk lands
    /// on the block after each skip without a primed pipeline and must prime it there for the
    /// tail; every request prefix and every divergence point gives exact per-replica blocks.
    #[test]
    fn walks_land_after_runs_and_prime_the_tail() {
        let keys: Vec<[u8; 8]> = (0..64u64).map(|i| (i * 7_919 + 3).to_be_bytes()).collect();
        for nrep in [8usize, 70] {
            let ix = Index::new(
                IndexConfig::default(),
                Arc::new(DefaultResolvers),
                Arc::new(ManualClock::new(NOW)),
            );
            let held = |r: usize| match r {
                0 => 64,
                1 => 32,
                _ => 16,
            };
            // Shortest first, so the longer ingests find their leading blocks held (runs).
            for r in (2..nrep).chain([1, 0]) {
                chain(&ix, &format!("r{r:03}"), &keys[..held(r)]);
            }
            assert!(ix.memory_breakdown().chain_runs > 0, "runs were built");
            let fresh = 0xDEAD_BEEF_u64.to_be_bytes();
            for len in 1..=64 {
                for cut in 0..=len {
                    let mut req = keys[..len].to_vec();
                    if cut < len {
                        req[cut] = fresh;
                    }
                    let mut want: Vec<(String, i32, u32)> = (0..nrep)
                        .filter_map(|r| {
                            let b = held(r).min(cut) as u32;
                            (b > 0).then(|| (format!("r{r:03}"), 16 * b as i32, b))
                        })
                        .collect();
                    want.sort();
                    assert_eq!(
                        matches(&ix, &req),
                        want,
                        "nrep {nrep}, len {len}, cut {cut}"
                    );
                }
            }
        }
    }
}
