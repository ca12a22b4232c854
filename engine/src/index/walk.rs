//! The core longest-prefix match (L4 steps 1–4): a walk of a request's block hashes over one
//! partition's run store (`raw/run_store/`), which hands over the request in stretches, each
//! held by exactly its run's live holders with one state per holder. So the replicas' runs are
//! merged once per stretch, not once per block: a bitset path when every replica fresh at block
//! 0 has a scope-local index below 64, and the general path.

use super::Index;
use super::ranking::Ranked;
use super::ranking::formulas::{freshness, is_live};
use super::records::{Partition, ReplicaView, ScopeReplica};
use super::resolution::PartitionHandle;
use crate::clock::us_to_ms;
use crate::raw::block_run::BlockRun;
use crate::raw::holder::tier_wire;
use crate::raw::key::{Digests, EightByteKeys, Keys, Request, digest};
use crossbeam_epoch::{self as epoch, Guard};

/// One run of the core longest-prefix match (L4 steps 1–4).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChainMatch<'a> {
    /// Replica id.
    pub replica_id: &'a str,
    /// The replica's scope-local index: the same for the same replica while its scope names
    /// it; the sweep may give it to another replica once this one holds nothing.
    pub replica_index: u32,
    /// Σ of the request's counts over the run.
    pub matched_tokens: i32,
    /// Oldest `last_seen` over the run (µs, ms resolution).
    pub oldest_us: i64,
    /// Coldest tier over the run (wire value).
    pub tier: i32,
    /// Blocks in the run.
    pub blocks: u32,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Run {
    pub(super) rep: u32,
    pub(super) matched: i32,
    pub(super) oldest: i64,
    pub(super) tier: u8,
    pub(super) blocks: u32,
    pub(super) open: bool,
    /// The replica's scope record, fetched when its run opened (null: the index names no
    /// record). Read through [`Run::replica`] within the walk's guard.
    record: *const ScopeReplica,
}

impl Run {
    /// The replica's scope record.
    ///
    /// # Safety
    ///
    /// Called under the guard of the walk that left this run: a holder named the replica's
    /// index under that guard, so its slot keeps the record until the guard is dropped (see
    /// `ReplicaSlots`). A scratch's runs are cleared by the next walk.
    #[inline]
    pub(super) unsafe fn replica<'g>(&self, _guard: &'g Guard) -> Option<&'g ScopeReplica> {
        // SAFETY: per the contract above.
        unsafe { self.record.as_ref() }
    }
}

/// One replica's entries over one stretch of a walk, for LFU crediting: blocks
/// `from..to` of the request, each holding that replica's entry of this generation.
#[derive(Clone, Copy, Debug)]
pub(super) struct Stretch {
    pub(super) rep: u32,
    pub(super) generation: u32,
    pub(super) from: u32,
    pub(super) to: u32,
}

/// Reusable scratch space for [`Index::match_chain_into`].
#[derive(Default)]
pub struct MatchScratch {
    pub(super) runs: Vec<Run>,
    pub(super) ranked: Vec<Ranked>,
    /// With capture on: every open replica's entries, stretch by stretch.
    pub(super) stretches: Vec<Stretch>,
    /// The request's key digests.
    digests: Vec<u64>,
    /// Bitset path: where replica `r`'s run is in `runs` (indices < 64), sized 64 once.
    index_of: Vec<u8>,
}

impl Index {
    /// L4 steps 1–4: the longest common leading run of every replica fresh at block 0. Leaves
    /// the closed runs in `scratch.runs`, sorted by replica index, and, with `capture`, every
    /// open replica's entries stretch by stretch in `scratch.stretches`. `ttl_ms` is called
    /// once block 0 is found; returns what it answered (0 when it was not called: no runs).
    /// A TTL ≤ 0 matches nothing.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn walk_chain<K: WalkKeys>(
        part: &Partition,
        keys: K,
        counts: &[i32],
        now_ms: i64,
        ttl_ms: impl FnOnce() -> i64,
        guard: &Guard,
        scratch: &mut MatchScratch,
        capture: bool,
    ) -> i64 {
        scratch.runs.clear();
        scratch.stretches.clear();
        let n = keys.len().min(counts.len());
        if n == 0 {
            return 0;
        }
        let (keys, counts) = (keys.prefix(n), &counts[..n]);
        // Block 0 first: a request whose first block is absent (Q0) costs one probe, not a
        // pass over its keys, nor the resolution of its tenant's TTL.
        let Some(first) = part.store.first_block(keys.first_digest(), guard) else {
            return 0;
        };
        let ttl_ms = ttl_ms();
        if ttl_ms <= 0 {
            return ttl_ms;
        }
        let MatchScratch {
            runs,
            stretches,
            digests,
            index_of,
            ..
        } = scratch;
        if index_of.len() < 64 {
            index_of.resize(64, 0);
        }
        let mut merge = Merge {
            replicas: part.scope.replicas.load(guard),
            now_ms,
            ttl_ms,
            counts,
            acc: 0,
            open: 0,
            index_of: &mut index_of[..64],
            general: false,
            runs,
            open_general: 0,
            stretches: capture.then_some(stretches),
        };
        let visit = |run: &BlockRun, from, to| merge.stretch(run, from, to);
        let end = keys.walk(part, first, digests, guard, visit);
        merge.finish(end);
        ttl_ms
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
        sink: impl FnMut(ChainMatch<'_>),
    ) {
        self.match_into(part, hashes, counts, now_us, scratch, sink);
    }

    /// [`Index::match_chain_into`] for a request of 8-byte keys given as their big-endian
    /// values (`u64::from_be_bytes(key)`: the key table's digest of an 8-byte key), as a
    /// caller that keeps block hashes as integers has them: nothing to convert per key.
    pub fn match_digests_into(
        &self,
        part: PartitionHandle<'_>,
        digests: &[u64],
        counts: &[i32],
        now_us: i64,
        scratch: &mut MatchScratch,
        sink: impl FnMut(ChainMatch<'_>),
    ) {
        self.match_into(part, Digests::new(digests), counts, now_us, scratch, sink);
    }

    fn match_into(
        &self,
        part: PartitionHandle<'_>,
        keys: impl WalkKeys,
        counts: &[i32],
        now_us: i64,
        scratch: &mut MatchScratch,
        mut sink: impl FnMut(ChainMatch<'_>),
    ) {
        let p = part.p;
        let now_ms = us_to_ms(now_us);
        let guard = epoch::pin();
        let ttl = Self::walk_chain(
            p,
            keys,
            counts,
            now_ms,
            || self.ttl_for(&p.tenant.name),
            &guard,
            scratch,
            false,
        );
        if scratch.runs.is_empty() {
            return;
        }
        for r in scratch.runs.iter() {
            if r.matched <= 0 || freshness(now_ms, r.oldest, ttl) <= 0.0 {
                continue;
            }
            // SAFETY: under the guard of the walk that left the run.
            let Some(rr) = (unsafe { r.replica(&guard) }) else {
                continue;
            };
            sink(ChainMatch {
                replica_id: &rr.name,
                replica_index: r.rep,
                matched_tokens: r.matched,
                oldest_us: r.oldest * 1000,
                tier: tier_wire(r.tier),
                blocks: r.blocks,
            });
        }
    }
}

/// A request's keys as a walk takes them: its first digest (block 0's probe) before anything
/// else, then the walk over the run store.
pub(super) trait WalkKeys: Copy {
    fn len(&self) -> usize;
    /// The first `n` keys (`n ≤ len`).
    fn prefix(self, n: usize) -> Self;
    /// Block 0's digest (`len > 0`).
    fn first_digest(&self) -> u64;
    /// [`crate::raw::run_store::RunStore::walk_from`] from block 0's slot value; `digests` is
    /// scratch space for keys whose digests are computed up front.
    fn walk(
        self,
        part: &Partition,
        first: u64,
        digests: &mut Vec<u64>,
        guard: &Guard,
        visit: impl FnMut(&BlockRun, usize, usize) -> bool,
    ) -> usize;
}

impl<H: AsRef<[u8]>> WalkKeys for &[H] {
    fn len(&self) -> usize {
        <[H]>::len(self)
    }
    fn prefix(self, n: usize) -> Self {
        &self[..n]
    }
    fn first_digest(&self) -> u64 {
        digest(self[0].as_ref())
    }
    fn walk(
        self,
        part: &Partition,
        first: u64,
        digests: &mut Vec<u64>,
        guard: &Guard,
        visit: impl FnMut(&BlockRun, usize, usize) -> bool,
    ) -> usize {
        // 8-byte keys (the usual request) are compared in place; keys of other lengths get
        // their digests (XXH3) computed once, up front.
        match EightByteKeys::new(self) {
            Some(keys) => part.store.walk_from(first, keys, guard, visit),
            None => {
                digests.clear();
                digests.extend(self.iter().map(|h| digest(h.as_ref())));
                match Keys::with_bytes(digests, self) {
                    Some(keys) => part.store.walk_from(first, keys, guard, visit),
                    None => 0,
                }
            }
        }
    }
}

/// 8-byte keys given as their big-endian values ([`Index::match_digests_into`]).
impl WalkKeys for Digests<'_> {
    fn len(&self) -> usize {
        Request::len(self)
    }
    fn prefix(self, n: usize) -> Self {
        Digests::prefix(self, n)
    }
    fn first_digest(&self) -> u64 {
        self.digest(0)
    }
    fn walk(
        self,
        part: &Partition,
        first: u64,
        _: &mut Vec<u64>,
        guard: &Guard,
        visit: impl FnMut(&BlockRun, usize, usize) -> bool,
    ) -> usize {
        part.store.walk_from(first, self, guard, visit)
    }
}

/// The replicas' runs as a walk merges them, stretch by stretch.
struct Merge<'s> {
    /// The scope's replica records: each replica that opens a run has its record fetched then,
    /// so the ranking that follows the walk does not wait for it.
    replicas: ReplicaView<'s>,
    now_ms: i64,
    ttl_ms: i64,
    counts: &'s [i32],
    /// Σ of the request's counts over the blocks walked so far (wrapping).
    acc: i32,
    /// Bitset path: the open replicas, and where each replica fresh at block 0 has its run in
    /// `runs`.
    open: u64,
    index_of: &'s mut [u8],
    /// Whether a replica fresh at block 0 has an index ≥ 64 (the general path).
    general: bool,
    /// One run per replica fresh at block 0: in holder order until [`Merge::finish`] sorts it.
    runs: &'s mut Vec<Run>,
    open_general: usize,
    stretches: Option<&'s mut Vec<Stretch>>,
}

impl Merge<'_> {
    /// Merges the stretch `from..to` of the request, which `run`'s live holders hold; returns
    /// whether a replica is still open.
    #[inline]
    fn stretch(&mut self, run: &BlockRun, from: usize, to: usize) -> bool {
        let (now_ms, ttl_ms) = (self.now_ms, self.ttl_ms);
        if from == 0 {
            self.start(run);
        } else if self.general {
            self.merge_general(run, from);
        } else {
            let mut still = 0u64;
            let open = self.open;
            let (runs, index_of) = (&mut *self.runs, &*self.index_of);
            run.for_each_holder(|_, h| {
                let r = h.rep();
                if r < 64 && open & (1 << r) != 0 && is_live(now_ms, h.last_seen_ms(), ttl_ms) {
                    still |= 1 << r;
                    let run = &mut runs[usize::from(index_of[r as usize])];
                    run.oldest = run.oldest.min(h.last_seen_ms());
                    run.tier = run.tier.max(h.tier());
                }
            });
            let mut closed = open & !still;
            while closed != 0 {
                let r = closed.trailing_zeros() as usize;
                closed &= closed - 1;
                let run = &mut runs[usize::from(index_of[r])];
                run.matched = self.acc;
                run.blocks = from as u32;
                run.open = false;
            }
            self.open = still;
        }
        for &c in &self.counts[from..to] {
            self.acc = self.acc.wrapping_add(c);
        }
        if let Some(out) = self.stretches.as_deref_mut() {
            let (open, general, runs) = (self.open, self.general, &*self.runs);
            run.for_each_holder(|_, h| {
                let r = h.rep();
                let is_open = if general {
                    runs.iter().any(|x| x.open && x.rep == r)
                } else {
                    r < 64 && open & (1 << r) != 0
                };
                if is_open {
                    out.push(Stretch {
                        rep: r,
                        generation: h.generation(),
                        from: from as u32,
                        to: to as u32,
                    });
                }
            });
        }
        if self.general {
            self.open_general > 0
        } else {
            self.open != 0
        }
    }

    /// Block 0's stretch: every live holder opens a run. One pass fills the runs and the bitset
    /// path's state; a replica index ≥ 64 among them (rare: the scope has named more than 64
    /// replicas) switches to the general path, which a second pass fills.
    fn start(&mut self, run: &BlockRun) {
        let (now_ms, ttl_ms, replicas) = (self.now_ms, self.ttl_ms, self.replicas);
        // Each run keeps its replica's record, fetched now: the ranking after the walk reads
        // it without looking the index up again, and finds it in cache.
        let fresh = |h: &crate::raw::holder::Holder| Run {
            rep: h.rep(),
            matched: 0,
            oldest: h.last_seen_ms(),
            tier: h.tier(),
            blocks: 0,
            open: true,
            record: replicas.fetch(h.rep() as usize),
        };
        let mut wide = false;
        let (runs, index_of, open) = (&mut *self.runs, &mut *self.index_of, &mut self.open);
        run.for_each_holder(|_, h| {
            if is_live(now_ms, h.last_seen_ms(), ttl_ms) {
                match h.rep() {
                    // A run's live holders name distinct replicas, and fewer than 64 of them
                    // reach here, so an index fits a byte.
                    r @ 0..64 => {
                        *open |= 1 << r;
                        index_of[r as usize] = runs.len() as u8;
                        runs.push(fresh(&h));
                    }
                    _ => wide = true,
                }
            }
        });
        if !wide {
            return;
        }
        self.open = 0;
        self.general = true;
        runs.clear();
        run.for_each_holder(|_, h| {
            if is_live(now_ms, h.last_seen_ms(), ttl_ms) {
                runs.push(fresh(&h));
            }
        });
        self.open_general = runs.len();
    }

    /// General path: each open run continues if `run` holds its replica, live, else closes at
    /// block `from`.
    fn merge_general(&mut self, run: &BlockRun, from: usize) {
        let (now_ms, ttl_ms, acc) = (self.now_ms, self.ttl_ms, self.acc);
        for r in self.runs.iter_mut().filter(|r| r.open) {
            let mut held = None;
            run.for_each_holder(|_, h| {
                if h.rep() == r.rep && is_live(now_ms, h.last_seen_ms(), ttl_ms) {
                    held = Some(h);
                }
            });
            match held {
                Some(h) => {
                    r.oldest = r.oldest.min(h.last_seen_ms());
                    r.tier = r.tier.max(h.tier());
                }
                None => {
                    r.open = false;
                    r.matched = acc;
                    r.blocks = from as u32;
                    self.open_general -= 1;
                }
            }
        }
    }

    /// Closes the runs still open at block `end` (where the walk stopped) and sorts `runs` by
    /// replica index (holders usually come in that order already).
    fn finish(self, end: usize) {
        for r in self.runs.iter_mut().filter(|r| r.open) {
            r.open = false;
            r.matched = self.acc;
            r.blocks = end as u32;
        }
        if !self.runs.is_sorted_by_key(|r| r.rep) {
            self.runs.sort_unstable_by_key(|r| r.rep);
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
        let mut indexes = Vec::new();
        ix.match_chain_into(p, keys, &counts, NOW, &mut scratch, |m| {
            v.push((m.replica_id.to_string(), m.matched_tokens, m.blocks));
            indexes.push((m.replica_index, m.replica_id.to_string()));
        });
        // The same request given as the keys' big-endian values answers the same, in the
        // same order, with the same replica indexes.
        let digests: Vec<u64> = keys.iter().map(|k| u64::from_be_bytes(*k)).collect();
        let mut by_digests = Vec::new();
        ix.match_digests_into(p, &digests, &counts, NOW, &mut scratch, |m| {
            by_digests.push((m.replica_index, m.replica_id.to_string()));
        });
        assert_eq!(by_digests, indexes);
        let mut distinct = indexes.iter().map(|(i, _)| *i).collect::<Vec<_>>();
        distinct.dedup();
        assert_eq!(
            distinct.len(),
            indexes.len(),
            "one replica index per replica"
        );
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
        // (chain length, replica r holds 1 + r % modulo blocks): every replica ends its holding
        // somewhere else, so the chain splits into many stretches.
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

    /// Both walk paths step over runs (the replicas share the chain's runs, split where their
    /// holders differ) and stop exactly where a replica's holder ends or was removed:
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
            assert!(ix.memory_breakdown().runs > 0, "runs were built");
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
            assert!(ix.memory_breakdown().runs > 0, "runs were built");
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
