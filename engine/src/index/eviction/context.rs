//! One enforcement's context ([`Cx`]: its mode, the algorithms resolved so far, the calling
//! ingest's held-back deltas, the eviction counts) and the ranks candidates are compared by.

use super::super::Index;
use super::super::counters::{HeldBackDeltas, Pending};
use super::super::records::{Partition, TenantRec};
use super::EVICT_SLOTS;
use super::hand::{Mode, Rank};
use crate::config::Algorithm;
use crate::raw::block_run::BlockRun;
use crate::raw::holder::Holder;
use crate::sync::Ordering;
use crossbeam_epoch::Guard;

/// Per-enforcement context: the mode and the algorithms resolved so far (once per tenant per
/// enforcement, V3 "resolved at eviction time", C4).
pub(super) struct Cx<'a> {
    pub(super) mode: Mode,
    /// (tenant record address, algorithm) resolved in this enforcement.
    pub(super) algs: Vec<(usize, Algorithm)>,
    pub(super) now_us: i64,
    /// The calling ingest's held-back deltas (cap mode).
    pub(super) carry: Option<HeldBackDeltas<'a>>,
    /// Cap evictions per `evict_slot`, counted once at the end of the enforcement.
    pub(super) evicted: [u64; EVICT_SLOTS],
}

impl Cx<'_> {
    pub(super) fn alg(&mut self, ix: &Index, t: &TenantRec) -> Algorithm {
        if self.mode == Mode::Quota {
            return Algorithm::Lru; // quota order is always age-based (V5)
        }
        let key = t as *const TenantRec as usize;
        if let Some(&(_, a)) = self.algs.iter().find(|(p, _)| *p == key) {
            return a;
        }
        let a = ix.resolvers.algorithm(&t.name);
        self.algs.push((key, a));
        a
    }

    /// Whether a partition holds candidates for this mode.
    pub(super) fn eligible(&self, p: &Partition) -> bool {
        match self.mode {
            Mode::Cap => !p.tenant.reserved && self.entries(p) > 0,
            Mode::Quota => p.keys.load(Ordering::Relaxed) > 0,
        }
    }

    pub(super) fn weight(&self, p: &Partition) -> i64 {
        match self.mode {
            Mode::Cap if p.tenant.reserved => 0,
            Mode::Cap => self.entries(p).max(0),
            Mode::Quota => p.keys.load(Ordering::Relaxed).max(0),
        }
    }

    /// `p`'s entries, counting the carry's held-back delta (a partition that only this ingest
    /// filled is still a candidate).
    pub(super) fn entries(&self, p: &Partition) -> i64 {
        let held = match &self.carry {
            Some(c) if std::ptr::eq(c.part, p) => c.pend.entries,
            _ => 0,
        };
        p.entries.load(Ordering::Relaxed) + held
    }

    /// Applies a cap victim's deltas: folded into the carry when the victim is of its
    /// partition (key counts) and replica (entries, serving), else applied now.
    pub(super) fn settle(
        &mut self,
        ix: &Index,
        part: &Partition,
        rep: u32,
        mut pend: Pending,
        g: &Guard,
    ) {
        if let Some(c) = &mut self.carry
            && std::ptr::eq(c.part, part)
        {
            c.pend.keys += std::mem::take(&mut pend.keys);
            if c.rep == rep {
                c.pend.entries += std::mem::take(&mut pend.entries);
            }
        }
        ix.flush_derived(part, rep, &mut pend, g);
    }

    /// Applies what the enforcement held back: the carry and the eviction counts.
    pub(super) fn finish(&mut self, ix: &Index) {
        if let Some(c) = self.carry.take() {
            c.apply(ix);
        }
        for (slot, n) in self.evicted.iter_mut().enumerate() {
            if *n > 0 {
                ix.evictions[slot].fetch_add(std::mem::take(n), Ordering::Relaxed);
            }
        }
    }
}
/// An entry's `eff_count` (V2): its access count under LFU, else 0.
pub(super) fn eff_count(
    p: &Partition,
    digest: u64,
    h: &Holder,
    alg: Algorithm,
    guard: &Guard,
) -> u64 {
    if alg != Algorithm::Lfu {
        return 0;
    }
    p.lfu
        .cell(digest, h.rep(), h.generation(), guard)
        .map_or(0, |c| c.count())
}

/// A key's quota age (V5): the max `last_seen` over its holders.
pub(super) fn key_age(holders: &[Holder]) -> i64 {
    holders
        .iter()
        .map(|h| h.last_seen_ms())
        .max()
        .unwrap_or(i64::MIN)
}

/// The quota age of key `o` of `run` (its holders are the run's).
pub(super) fn run_age(run: &BlockRun) -> i64 {
    let mut age = i64::MIN;
    run.for_each_holder(|_, h| age = age.max(h.last_seen_ms()));
    age
}

impl Index {
    /// Calls `f(rank, rep, generation)` for each candidate of key `o` of `run` (cap: each
    /// holder; quota: the key once).
    pub(super) fn visit(
        &self,
        cx: &mut Cx,
        p: &Partition,
        run: &BlockRun,
        o: usize,
        guard: &Guard,
        mut f: impl FnMut(Rank, u32, u32),
    ) {
        match cx.mode {
            Mode::Cap => {
                let alg = cx.alg(self, &p.tenant);
                let digest = run.key(o);
                run.for_each_holder(|_, h| {
                    let e = eff_count(p, digest, &h, alg, guard);
                    f((e, h.last_seen_ms()), h.rep(), h.generation());
                });
            }
            Mode::Quota => f((0, run_age(run)), 0, 0),
        }
    }
}
