//! Global cap (V2) and tenant quotas (V5): victim selection and removal (D6).
//!
//! Both run at the end of an ingest (K14 steps 3 and 4), never in the sweep and never on events
//! (E7), and only remove through the partitions' writer locks as every other removal does (one
//! short hold per victim), so readers are never blocked (C1, C5).
//!
//! **Ideal order.** Cap: `(eff_count, last_seen, tenant, model, scheme, adapter, hash,
//! replica_id)` ascending over non-reserved storage entries, `eff_count` = the entry's access
//! count if its tenant's algorithm is LFU at eviction time, else 0. Quota: whole keys of the
//! ingesting tenant by `(max last_seen over holders, model, scheme, adapter, hash)`.
//!
//! **Exact path.** When the whole candidate population is small (≤ [`EXACT_MAX`] non-reserved
//! entries for the cap, ≤ [`EXACT_MAX`] keys of the tenant for the quota) it is enumerated and
//! the victims are exactly the ideal order (the spec requires this up to 16; the small acceptance
//! scenarios and the oracle stay deterministic and seed-independent).
//!
//! **Approximate path** (a sampled threshold plus a walking hand, amortized O(1) expected per
//! victim, no full scan or sort per ingest):
//! 1. *Sample*: [`SAMPLES`] random keys (partition chosen with probability proportional to its
//!    entry — or key — count, then a random key-table slot; empty slots are retried), every
//!    holder of a sampled key contributing its rank `(eff_count, last_seen)` (cap) or the key's
//!    rank `(0, max last_seen)` (quota). The threshold is the sample at rank [`THRESHOLD_RANK`]
//!    (≈ the 6% quantile of the population), or at [`THRESHOLD_RANK_BY_AGE`] (≈ 9%) when all
//!    samples share one `eff_count` (pure age order); the samples at or below it are the first
//!    candidates.
//! 2. *Walk*: a persistent cursor (partition, position) walks the partitions lock-free: the
//!    cap's LRU partitions by their run registry, the others (LFU, and the quotas, whose
//!    victims are whole keys) by their key table in key order (an LFU victim, an entry of a low
//!    count, is often new, and a new run takes the registry id its victim freed, just behind
//!    the cursor; in key order such entries are spread evenly over a lap). Each registry entry
//!    keeps its run's *age*, a lower bound of its holders'
//!    `last_seen` (`raw/block_run.rs`, [`RunIds`](crate::raw::block_run::RunIds)), so with a
//!    threshold count of 0 a run younger than the threshold is passed on its entry alone and
//!    only old runs are read. An old run's live blocks (under LRU its first one: step 4 brings
//!    the rest) give their holders whose rank is ≤ the threshold as candidates, into a small
//!    buffer (≤ [`CANDIDATES`] per refill, at most [`WALK_BUDGET`] registry entries), sorted so
//!    the smallest rank goes first. Ids are reused in the order runs go, so from the cursor on
//!    runs lie roughly oldest first: a walk that has candidates stops in front of the first
//!    young run (past it, a stale threshold would leave runs a fresh one takes for a whole
//!    lap), and a walk that finds nothing sets the cursor back once for a fresh threshold to
//!    walk the same runs.
//! 3. *Evict*: pop the smallest candidate, re-validate it under its partition's writer lock
//!    (still present, same generation, rank still ≤ the threshold, index still over the cap: a
//!    re-ingest or credit since the walk saves it) and remove it.
//! 4. *Run mates* (cap, LRU): a victim queues the other live blocks of its run (up to
//!    [`MAX_MATES`]) as the next candidates. They carry the same holder entry — the victim's
//!    replica with the same `last_seen` and generation, so tied with it in the ideal order —
//!    and are taken while the index is still over the cap, each re-validated like any
//!    candidate (present, same generation, rank ≤ threshold). A chain thus leaves whole, and
//!    its run with it, instead of block by block over a lap of the walk (test
//!    `cap_evicts_chains_whole_with_their_run_mates`).
//! 5. *Re-sample* after a lap of the cursor, after about half of the estimated population below
//!    the threshold was evicted (the threshold goes stale as its entries disappear), or when a
//!    walk finds nothing within its budget.
//!
//! Quality: every victim has a rank within the lowest ~6% (age order: ~9%) (± sampling noise)
//! of the population at sampling time, and below-threshold candidates are taken smallest first;
//! where ids follow eviction order (fresh ingests at the cap) the walk is close to exact LRU.
//! T86 (LRU, N = 100,000, cap 50,000: ≥ 95% of survivors from the newest half) and T87 (LFU)
//! check it over sampler seeds; `cargo run --release -p inferencecache-bench --bin eviction`
//! measures quality and cost for N = 100k and 1M (`bench/results/eviction.md`).
//!
//! Cost: ≈ 1/quantile ≈ 11 (age order) to 15 registry entries per victim (16 bytes each,
//! sequential), one read of each old run, one re-probe and the removal under the partition's
//! writer lock; the 64-sample re-estimation is amortized over ~3% of the population. Mixed LFU
//! counts (a threshold count above 0) read every run the walk passes. Quotas, which have no
//! cost bar, take the 4th of 64 (≈ 6%).
//!
//! **Counters.** The cap runs holding the calling ingest's key and entry deltas ([`HeldBackDeltas`]): a
//! victim of the same partition folds its own deltas into them (and of the same replica, its
//! entry and serving deltas too), and the sum is applied once at the end, so an insert and its
//! victim in one namespace touch no shared counter but the entry count, which removals lower at
//! once, before the unlink (loom m8a). The partition weights of the sampling count the held
//! entries; eviction counts are summed per enforcement.

use super::Index;
use super::ingest::{HeldBackDeltas, Pending};
use super::records::{Partition, TenantRec};
use super::route::{KeyBytesOwned, own_key};
use crate::ReplicaId;
use crate::config::Algorithm;
use crate::raw::block_run::{BlockRun, ScanStep};
use crate::raw::holder::{Holder, key_parts};
use crate::raw::run_store::KeyBytes;
use crate::sink::{ChangeEvent, ChangeKind};
use crate::sync::Ordering;
use crossbeam_epoch::{self as epoch, Guard};
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::{Arc, Weak};

/// Eviction reason for `index_evictions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EvictionReason {
    /// Global cap (V2).
    Cap,
    /// TTL sweep (V1).
    Ttl,
}

/// Eviction counters: (LRU, LFU) × (cap, TTL), indexed by [`evict_slot`].
pub(super) const EVICT_SLOTS: usize = 4;

pub(super) fn evict_slot(a: Algorithm, r: EvictionReason) -> usize {
    (match a {
        Algorithm::Lru => 0,
        Algorithm::Lfu => 2,
    }) + match r {
        EvictionReason::Cap => 0,
        EvictionReason::Ttl => 1,
    }
}

/// Populations up to this size are enumerated and evicted in the exact ideal order.
pub(crate) const EXACT_MAX: i64 = 64;
/// Samples per threshold estimate.
const SAMPLES: usize = 64;
/// Slot probes per estimate before giving up on finding [`SAMPLES`] keys.
const SAMPLE_ATTEMPTS: usize = SAMPLES * 16;
/// Index of the threshold in the sorted samples (the 4th smallest of 64: ≈ 6% quantile; see
/// the module docs for the quality / cost trade-off).
const THRESHOLD_RANK: usize = 3;
/// Threshold index when every sample has the same `eff_count` (LRU, or LFU with nothing
/// credited): the order is by age alone and the 6th smallest (≈ 9% quantile) keeps walks short;
/// with mixed counts a looser threshold would admit credited entries while uncredited ones
/// remain.
const THRESHOLD_RANK_BY_AGE: usize = 5;
/// Threshold index for quotas (always by age): the 4th smallest (≈ 6%). The quota has no cost
/// bar; at the 7th smallest the worst N/2 quality of 240 runs (60 processes × 4 seeds) was at
/// the edge of V5's 95% (94.96–95.65%), at the 4th 96.79%.
const THRESHOLD_RANK_QUOTA: usize = 3;
/// Candidate buffer size.
const CANDIDATES: usize = 32;
/// Recent new entries the cap remembers (LFU namespaces only), oldest dropped first.
const RECENT_RING: usize = 1024;
/// Ring entries examined per step before falling back to the buffer.
const RECENT_TRIES: usize = 4;
/// Registry entries a refill walks at most.
const WALK_BUDGET: usize = 8192;
/// Registry entries scanned per step of a walk.
const WALK_STEP: usize = 512;

/// Where one step of the walk over a partition left it.
struct WalkStep {
    /// The partition's position to go on from.
    pos: u64,
    /// Positions passed (the walk's budget counts them).
    visited: usize,
    /// The step reached the partition's end.
    lapped: bool,
    /// The step stopped in front of a young run ([`Index::walk_runs`]): the refill ends.
    at_young: bool,
}

/// The `visit` callback of a walk: pushes each ranked entry of `key` (in partition `part`) at
/// or below `thr` into `cands`.
fn candidates_at_most<'a>(
    thr: Rank,
    part: usize,
    key: &'a [u8],
    cands: &'a mut Vec<Victim>,
) -> impl FnMut(Rank, u32, u32) + 'a {
    move |rank, rep, generation| {
        if rank <= thr {
            cands.push(Victim {
                rank,
                part,
                key: own_key(key),
                rep,
                generation,
            });
        }
    }
}

/// Comparable prefix of the ideal order used by the approximate path: `(eff_count, last_seen)`.
type Rank = (u64, i64);

const RANK_MAX: Rank = (u64::MAX, i64::MAX);

/// The seed of a hand: the configured seed mixed with a per-hand salt.
pub(crate) fn seed_of(seed: u64, salt: u64) -> u64 {
    mix(seed ^ salt.rotate_left(29) ^ 0x5851_f42d_4c95_7f2d)
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// V2: storage entries of non-reserved tenants.
    Cap,
    /// V5: whole keys of one tenant.
    Quota,
}

/// A new storage entry with an 8-byte key, as an ingest reports it to the cap (see
/// [`Index::enforce_cap`]): its partition, key, replica and generation.
#[derive(Clone, Copy)]
pub(crate) struct RecentEntry {
    pub(crate) part: PartPtr,
    pub(crate) key: u64,
    pub(crate) rep: u32,
    pub(crate) generation: u32,
}

/// A partition named without a lifetime, for the cap's recent-entries ring, which outlives the
/// ingests that fill it. Whoever dereferences one shows that the partition is not reclaimed yet
/// (an ingest still entered in it, or the ring's clearing by the sweep: see `recent_step`).
#[derive(Clone, Copy)]
pub(crate) struct PartPtr(NonNull<Partition>);

// SAFETY: a `PartPtr` is a shared reference to a `Partition` (which is `Sync`) without its
// lifetime; sending or sharing it hands over nothing else, and every dereference states why the
// partition is alive.
unsafe impl Send for PartPtr {}
// SAFETY: as for `Send`: only `&Partition` can be had from it.
unsafe impl Sync for PartPtr {}

impl PartPtr {
    pub(crate) fn new(part: &Partition) -> Self {
        Self(NonNull::from(part))
    }

    /// The partition.
    ///
    /// # Safety
    /// The partition has not been reclaimed, and is not while the reference is used.
    unsafe fn get<'a>(self) -> &'a Partition {
        // SAFETY: (caller) the partition is alive for `'a`.
        unsafe { self.0.as_ref() }
    }
}

/// A candidate victim (cap: one storage entry; quota: one key, `rep`/`generation` unused).
struct Victim {
    rank: Rank,
    part: usize,
    key: KeyBytesOwned,
    rep: u32,
    generation: u32,
}

/// Run mates queued per cap victim at most (longer runs leave the rest to the walk).
const MAX_MATES: usize = 256;

/// Victim-selection state (one for the global cap, one per tenant for its quota). Guarded by a
/// mutex: enforcement is serialized per hand, never with readers.
pub(crate) struct Hand {
    rng: u64,
    /// Partitions the hand works on (cap: every partition, appended as they are created;
    /// quota: the tenant's partitions, refreshed per enforcement and empty between them).
    parts: Vec<Arc<Partition>>,
    /// Quota only: the partitions of the last enforcement, held weakly until the next one (see
    /// [`Hand::rest`]).
    resting: Vec<Weak<Partition>>,
    cum: Vec<i64>,
    samples: Vec<Victim>,
    cands: Vec<Victim>,
    /// Current threshold (None: estimate before the next walk).
    thr: Option<Rank>,
    /// Victims still to take before re-estimating.
    budget: u64,
    /// The cursor wrapped around since the last estimate.
    lapped: bool,
    /// The last walk found nothing and its runs are to be walked once more with a fresh
    /// threshold ([`Index::refill`]).
    rewalked: bool,
    /// Walk cursor: (partition, position): a run id in its run registry, or, in an LFU
    /// partition, a fraction of its key table ([`Index::walk_keys`]).
    cursor: (usize, u64),
    /// Cap only: new entries of LFU namespaces reported by earlier ingests, oldest first.
    recent: VecDeque<RecentEntry>,
    /// The cap's per-enforcement algorithm cache ([`Cx::algs`]), kept here between
    /// enforcements only for its allocation.
    algs: Vec<(usize, Algorithm)>,
}

impl Hand {
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            rng: seed,
            parts: Vec::new(),
            resting: Vec::new(),
            cum: Vec::new(),
            samples: Vec::new(),
            cands: Vec::new(),
            thr: None,
            budget: 0,
            lapped: false,
            rewalked: false,
            cursor: (0, 0),
            recent: VecDeque::new(),
            algs: Vec::new(),
        }
    }

    /// Ends a quota enforcement: its partitions stay known only weakly until the next one. A
    /// tenant owns its quota hand and each of its partitions holds the tenant, so strong
    /// references kept here would be a cycle. The next enforcement rebuilds the list from the
    /// tenant's pairs; the resting one only tells it (by its length) whether positions moved.
    pub(crate) fn rest(&mut self) {
        self.resting.clear();
        let parts = self.parts.drain(..);
        self.resting.extend(parts.map(|p| Arc::downgrade(&p)));
    }

    /// Drops the partitions `dead` selects (reclaimed by the sweep) and, if there were any,
    /// everything that refers to positions in the list or to partitions by address: the
    /// walk restarts and the threshold is estimated again.
    pub(crate) fn forget_parts(&mut self, dead: impl Fn(&Partition) -> bool) {
        let before = self.parts.len() + self.resting.len();
        self.parts.retain(|p| !dead(p));
        self.resting
            .retain(|p| p.upgrade().is_some_and(|p| !dead(&p)));
        if self.parts.len() + self.resting.len() != before {
            self.cands.clear();
            self.samples.clear();
            self.cum.clear();
            self.recent.clear();
            self.thr = None;
            self.budget = 0;
            self.lapped = false;
            self.rewalked = false;
            self.cursor = (0, 0);
        }
    }

    fn next(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.rng)
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: u64) -> u64 {
        ((self.next() as u128 * n as u128) >> 64) as u64
    }

    fn sort_cands(&mut self) {
        // Largest first, so `pop` yields the smallest rank.
        self.cands
            .sort_unstable_by_key(|v| std::cmp::Reverse(v.rank));
    }
}

/// Per-enforcement context: the mode and the algorithms resolved so far (once per tenant per
/// enforcement, V3 "resolved at eviction time", C4).
struct Cx<'a> {
    mode: Mode,
    /// (tenant record address, algorithm) resolved in this enforcement.
    algs: Vec<(usize, Algorithm)>,
    now_us: i64,
    /// The calling ingest's held-back deltas (cap mode; see [`HeldBackDeltas`]).
    carry: Option<HeldBackDeltas<'a>>,
    /// Cap evictions per `evict_slot`, counted once at the end of the enforcement.
    evicted: [u64; EVICT_SLOTS],
}

impl Cx<'_> {
    fn alg(&mut self, ix: &Index, t: &TenantRec) -> Algorithm {
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
    fn eligible(&self, p: &Partition) -> bool {
        match self.mode {
            Mode::Cap => !p.tenant.reserved && self.entries(p) > 0,
            Mode::Quota => p.keys.load(Ordering::Relaxed) > 0,
        }
    }

    fn weight(&self, p: &Partition) -> i64 {
        match self.mode {
            Mode::Cap if p.tenant.reserved => 0,
            Mode::Cap => self.entries(p).max(0),
            Mode::Quota => p.keys.load(Ordering::Relaxed).max(0),
        }
    }

    /// `p`'s entries, counting the carry's held-back delta (a partition that only this ingest
    /// filled is still a candidate).
    fn entries(&self, p: &Partition) -> i64 {
        let held = match &self.carry {
            Some(c) if std::ptr::eq(c.part, p) => c.pend.entries,
            _ => 0,
        };
        p.entries.load(Ordering::Relaxed) + held
    }

    /// Applies a cap victim's deltas: folded into the carry when the victim is of its
    /// partition (key counts) and replica (entries, serving), else applied now.
    fn settle(&mut self, ix: &Index, part: &Partition, rep: u32, mut pend: Pending, g: &Guard) {
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
    fn finish(&mut self, ix: &Index) {
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
fn eff_count(p: &Partition, digest: u64, h: &Holder, alg: Algorithm, guard: &Guard) -> u64 {
    if alg != Algorithm::Lfu {
        return 0;
    }
    p.lfu
        .cell(digest, h.rep(), h.generation(), guard)
        .map_or(0, |c| c.count())
}

/// A key's quota age (V5): the max `last_seen` over its holders.
fn key_age(holders: &[Holder]) -> i64 {
    holders
        .iter()
        .map(|h| h.last_seen_ms())
        .max()
        .unwrap_or(i64::MIN)
}

/// The quota age of key `o` of `run` (its holders are the run's).
fn run_age(run: &BlockRun) -> i64 {
    let mut age = i64::MIN;
    run.for_each_holder(|_, h| age = age.max(h.last_seen_ms()));
    age
}

impl Index {
    /// Calls `f(rank, rep, generation)` for each candidate of key `o` of `run` (cap: each
    /// holder; quota: the key once).
    fn visit(
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

    // ----------------------------------------------------------------------------------------
    // Entry points (called by `ingest`)

    /// Whether a cap is set and the non-reserved entries exceed it.
    pub(super) fn over_cap(&self) -> bool {
        let cap = self.cfg.max_entries;
        cap > 0 && self.storage_entries.load(Ordering::Relaxed) > cap
    }

    /// V2: while `effective = storage_entries − reserved_storage_entries > cap`, remove victims.
    /// (`storage_entries` already excludes reserved tenants, K15.) `created` are some of the
    /// entries the calling ingest just created; when the index is over the cap, those of LFU
    /// namespaces join the recent-entries ring *after* this enforcement, so an entry is never a
    /// ring victim of its own ingest.
    pub(super) fn enforce_cap(
        &self,
        created: &[Option<RecentEntry>],
        carry: Option<HeldBackDeltas<'_>>,
    ) {
        let cap = self.cfg.max_entries;
        if !self.over_cap() {
            if let Some(c) = carry {
                c.apply(self);
            }
            return;
        }
        let mut hand = self.cap_hand.lock();
        if hand.parts.len() < self.all_parts_len.load(Ordering::Acquire) {
            let all = self.all_parts.lock();
            let n = hand.parts.len();
            hand.parts.extend_from_slice(&all[n..]);
        }
        let mut algs = std::mem::take(&mut hand.algs);
        algs.clear();
        let mut cx = Cx {
            mode: Mode::Cap,
            algs,
            now_us: self.clock.now_us(),
            carry,
            evicted: [0; EVICT_SLOTS],
        };
        let mut stall = 0;
        loop {
            let pop = self.storage_entries.load(Ordering::Relaxed);
            if pop <= cap || stall >= 8 {
                break;
            }
            if pop <= EXACT_MAX {
                if self.exact_cap(&mut hand, &mut cx, pop - cap) == 0 {
                    stall += 1;
                }
                continue;
            }
            if self.recent_step(&mut hand, &mut cx) || self.approx_step(&mut hand, &mut cx, None) {
                stall = 0;
            } else {
                stall += 1;
            }
        }
        for e in created.iter().flatten() {
            // SAFETY: `e.part` names a partition the calling ingest is still entered in
            // (`Created::take`, `dir::Life`), so the sweep has not reclaimed it.
            let part = unsafe { e.part.get() };
            if !part.tenant.reserved && cx.alg(self, &part.tenant) == Algorithm::Lfu {
                if hand.recent.len() >= RECENT_RING {
                    hand.recent.pop_front();
                }
                hand.recent.push_back(*e);
            }
        }
        cx.finish(self);
        hand.algs = cx.algs;
    }

    /// V5 for the ingesting tenant `t`: while its distinct keys exceed its budget `B ≥ 0`,
    /// delete whole keys, oldest first. `B = 0` empties the tenant.
    ///
    /// `carry` holds the ingest's own key delta (its tenant is `t`): it counts here, and is
    /// applied before any removal, which reads the counters as they are.
    pub(super) fn enforce_quota(
        &self,
        t: &str,
        now_us: i64,
        carry: &mut Option<HeldBackDeltas<'_>>,
    ) {
        let Some(tr) = self
            .tenants
            .get_arc(crate::directory::hash_strs(&[t]), &|r: &TenantRec| {
                crate::directory::same_str(&r.name, t)
            })
        else {
            return;
        };
        let held = carry.as_ref().map_or(0, |c| c.pend.keys);
        if tr.keys.load(Ordering::Relaxed) + held <= 0 {
            return;
        }
        let budget = match self.resolvers.quota(t) {
            Some(b) if b >= 0 => b,
            _ => return,
        };
        if tr.keys.load(Ordering::Relaxed) + held <= budget {
            return;
        }
        if let Some(c) = carry.take() {
            c.apply(self);
        }
        let mut hand_slot = tr.quota_hand.lock();
        // The hand is made at the tenant's first enforcement: most tenants never reach their
        // quota, and an unused hand was ~250 bytes of every tenant record (issue 42).
        let hand: &mut Hand = hand_slot.get_or_insert_with(|| {
            Box::new(Hand::new(seed_of(
                self.cfg.eviction_seed,
                crate::directory::hash_strs(&[t]),
            )))
        });
        let before = hand.resting.len();
        hand.resting.clear();
        hand.parts.clear();
        for m in tr.models.lock().iter().filter_map(Weak::upgrade) {
            hand.parts
                .extend(m.parts.lock().iter().filter_map(Weak::upgrade));
        }
        if hand.parts.len() != before {
            // New partitions may shift positions: candidates and cursor refer to the old list.
            hand.cands.clear();
            hand.thr = None;
            hand.cursor = (0, 0);
        }
        let mut cx = Cx {
            mode: Mode::Quota,
            algs: Vec::new(),
            now_us,
            carry: None,
            evicted: [0; EVICT_SLOTS],
        };
        if budget == 0 {
            // Everything goes: no ordering needed.
            for p in hand.parts.iter() {
                self.remove_all_keys(p, &cx);
            }
        } else {
            let mut stall = 0;
            loop {
                let keys = tr.keys.load(Ordering::Relaxed);
                if keys <= budget || stall >= 8 {
                    break;
                }
                if keys <= EXACT_MAX {
                    if self.exact_quota(hand, &cx, keys - budget) == 0 {
                        stall += 1;
                    }
                    continue;
                }
                if self.approx_step(hand, &mut cx, Some(&tr)) {
                    stall = 0;
                } else {
                    stall += 1;
                }
            }
        }
        hand.rest();
    }

    // ----------------------------------------------------------------------------------------
    // Approximate path

    /// LFU feed: the oldest remembered new entry that is still present, still at or below the
    /// threshold (i.e. not credited since) and ranked ahead of the buffer's best candidate is
    /// evicted. New entries are the usual LFU victims (count 0), and once they are rare a walk
    /// has to visit many credited entries to find each one; the ring finds them directly.
    /// Every victim still satisfies the sampled threshold (quality argument unchanged).
    fn recent_step(&self, hand: &mut Hand, cx: &mut Cx) -> bool {
        let Some(thr) = hand.thr else {
            return false;
        };
        if hand.recent.is_empty() {
            return false; // LRU-only indexes never fill the ring: no pin for them
        }
        let guard = epoch::pin();
        for _ in 0..RECENT_TRIES {
            let Some(e) = hand.recent.front().copied() else {
                return false;
            };
            // SAFETY: the ring only names partitions in `hand.parts` (it is filled after the
            // hand caught up with `all_parts`), and the sweep clears it, under this hand's
            // lock, whenever it drops a reclaimed partition from the hand (`forget_parts`).
            let part = unsafe { e.part.get() };
            let key = e.key.to_be_bytes();
            let rank = part
                .store
                .entry(e.key, None, e.rep, &guard)
                .filter(|h| h.generation() == e.generation)
                .map(|h| {
                    let alg = cx.alg(self, &part.tenant);
                    (eff_count(part, e.key, &h, alg, &guard), h.last_seen_ms())
                });
            let Some(rank) = rank.filter(|r| *r <= thr) else {
                hand.recent.pop_front(); // gone, re-created, or credited since: forget it
                continue;
            };
            if hand.cands.last().is_some_and(|best| best.rank <= rank) {
                return false; // the buffer's best comes first in the ideal order
            }
            hand.recent.pop_front();
            let v = Victim {
                rank,
                part: usize::MAX, // not a position in `hand.parts`; unused by `evict_entry`
                key: own_key(&key),
                rep: e.rep,
                generation: e.generation,
            };
            if self.evict_entry(part, &v, thr, cx, None) {
                hand.budget = hand.budget.saturating_sub(1);
                return true;
            }
        }
        false
    }

    /// Evicts one candidate (refilling the buffer when empty). Returns whether progress was made
    /// (a victim removed, or fresh candidates found).
    fn approx_step(&self, hand: &mut Hand, cx: &mut Cx, tenant: Option<&TenantRec>) -> bool {
        let Some(v) = hand.cands.pop() else {
            return self.refill(hand, cx);
        };
        let thr = hand.thr.unwrap_or(RANK_MAX);
        // Borrowed, not cloned: the hand keeps its partitions, and a clone would be two locked
        // reference-count updates per victim.
        let part = &hand.parts[v.part];
        let removed = match cx.mode {
            Mode::Cap => self.evict_entry(part, &v, thr, cx, Some(&mut hand.cands)),
            Mode::Quota => self.evict_key(part, v.key.as_bytes(), thr.1, cx.now_us),
        };
        // The next victim's slots are random lines of a table larger than the caches: fetched
        // now, they arrive while the next ingest runs (the cap takes about one victim per
        // ingest at the cap).
        if let Some(next) = hand.cands.last() {
            let (digest, _) = key_parts(next.key.as_bytes());
            hand.parts[next.part]
                .store
                .prefetch_removal(digest, &epoch::pin());
        }
        if removed {
            hand.budget = hand.budget.saturating_sub(1);
            if let Some(t) = tenant {
                t.quota_evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        // A failed re-validation still consumed a candidate: progress.
        true
    }

    /// Refills the candidate buffer: a new estimate when due, then a bounded walk.
    fn refill(&self, hand: &mut Hand, cx: &mut Cx) -> bool {
        if hand.thr.is_none() || hand.budget == 0 || hand.lapped {
            self.estimate(hand, cx);
            if !hand.cands.is_empty() {
                hand.sort_cands();
                return true;
            }
        }
        if hand.thr.is_none() {
            return false;
        }
        let start = hand.cursor;
        self.walk(hand, cx);
        if hand.cands.is_empty() {
            // Too strict, or stale: re-estimate next time. The first time, the cursor goes
            // back to where this walk began, so the fresh threshold walks the same runs: they
            // lie roughly oldest first (ids are reused in eviction order), and skipped by a
            // stale threshold they would wait a whole lap while younger runs are taken. A
            // fresh threshold that finds nothing there either moves on.
            if !hand.rewalked {
                hand.cursor = start;
            }
            hand.rewalked = !hand.rewalked;
            hand.thr = None;
            return false;
        }
        hand.rewalked = false;
        hand.sort_cands();
        true
    }

    /// Samples the population, sets the threshold and seeds the buffer with the samples at or
    /// below it.
    fn estimate(&self, hand: &mut Hand, cx: &mut Cx) {
        hand.cands.clear();
        hand.samples.clear();
        hand.cum.clear();
        hand.lapped = false;
        let mut total = 0i64;
        for p in hand.parts.iter() {
            total += cx.weight(p);
            hand.cum.push(total);
        }
        if total <= 0 {
            hand.thr = None;
            return;
        }
        let guard = epoch::pin();
        let mut tries = 0;
        while hand.samples.len() < SAMPLES && tries < SAMPLE_ATTEMPTS {
            tries += 1;
            let r = hand.below(total as u64) as i64;
            let pi = hand.cum.partition_point(|&c| c <= r);
            let slot = hand.next();
            let p = &hand.parts[pi];
            let samples = &mut hand.samples;
            p.store.sample(slot, &guard, |digest, run, o| {
                let key = own_key(KeyBytes::new(digest, run.long_key(o)).as_ref());
                self.visit(cx, p, run, o, &guard, |rank, rep, generation| {
                    samples.push(Victim {
                        rank,
                        part: pi,
                        key: key.clone(),
                        rep,
                        generation,
                    });
                });
            });
        }
        if hand.samples.is_empty() {
            // Too sparse to sample: let the walk take anything.
            hand.thr = Some(RANK_MAX);
            hand.budget = 1;
            return;
        }
        hand.samples.sort_unstable_by_key(|v| v.rank);
        let uniform = hand.samples[0].rank.0 == hand.samples[hand.samples.len() - 1].rank.0;
        let k = match (cx.mode, uniform) {
            (Mode::Quota, _) => THRESHOLD_RANK_QUOTA,
            (Mode::Cap, true) => THRESHOLD_RANK_BY_AGE,
            (Mode::Cap, false) => THRESHOLD_RANK,
        }
        .min(hand.samples.len() - 1);
        let thr = hand.samples[k].rank;
        hand.thr = Some(thr);
        // Estimated population at or below the threshold; re-estimate after half of it.
        let below = (k as i64 + 1) * total / hand.samples.len() as i64;
        hand.budget = (below / 2).max(1) as u64;
        let n = hand.samples.partition_point(|v| v.rank <= thr);
        hand.cands.extend(hand.samples.drain(..n));
    }

    /// Walks the cursor lock-free over the partitions, collecting candidates at or below the
    /// threshold: the cap's LRU partitions by their run registry, the others by their key
    /// table in key order.
    fn walk(&self, hand: &mut Hand, cx: &mut Cx) {
        let Some(thr) = hand.thr else {
            return;
        };
        if hand.parts.is_empty() {
            return;
        }
        let (mut pi, mut pos) = hand.cursor;
        let mut visited = 0;
        let mut wraps = 0;
        while visited < WALK_BUDGET && hand.cands.len() < CANDIDATES {
            if pi >= hand.parts.len() {
                (pi, pos) = (0, 0);
                hand.lapped = true;
                wraps += 1;
                if wraps > 1 {
                    break; // nothing eligible at all
                }
                continue;
            }
            let p = &hand.parts[pi];
            if !cx.eligible(p) {
                (pi, pos) = (pi + 1, 0);
                visited += 1;
                continue;
            }
            let step = if cx.mode == Mode::Cap && cx.alg(self, &p.tenant) == Algorithm::Lru {
                self.walk_runs(cx, p, (pi, pos), thr, &mut hand.cands)
            } else {
                self.walk_keys(cx, p, (pi, pos), thr, &mut hand.cands)
            };
            visited += step.visited;
            pos = step.pos;
            if step.at_young {
                break;
            }
            if step.lapped {
                pos = 0;
                pi += 1;
            }
        }
        hand.cursor = (pi, pos);
    }

    /// One step of the walk over partition `p`'s run registry from position `at.1` (a run id).
    /// Each registry entry keeps its run's age, a lower bound of its holders' `last_seen`, so
    /// with a threshold count of 0 a run younger than the threshold holds no candidate and is
    /// passed on its entry alone; a higher count admits runs of any age.
    fn walk_runs(
        &self,
        cx: &mut Cx,
        p: &Partition,
        at: (usize, u64),
        thr: Rank,
        cands: &mut Vec<Victim>,
    ) -> WalkStep {
        let guard = epoch::pin();
        let (pi, pos) = (at.0, at.1 as usize);
        let max_age = if thr.0 == 0 { thr.1 } else { i64::MAX };
        // Under LRU a cap victim's run mates carry its holder entry and follow it (module
        // docs, step 4): a run's first live block stands for all of them. Otherwise (quota
        // victims are keys) every live block is a candidate.
        let blocks_per_run = if cx.mode == Mode::Cap && cx.alg(self, &p.tenant) == Algorithm::Lru {
            1
        } else {
            usize::MAX
        };
        let len = p.store.run_scan_len();
        // A position from a key-table walk (the tenant's algorithm changed) may lie past it.
        let pos = pos.min(len);
        let end = (pos + WALK_STEP).min(len);
        let mut at_young = false;
        let stopped = p.store.scan_runs(pos, end, max_age, &guard, |step| {
            let ScanStep::Old(run) = step else {
                // A young run after candidates: the walk stops in front of it. Runs lie
                // roughly oldest first from the cursor on (ids are reused in eviction order),
                // so the first young one is where a threshold gone stale starts to pass runs a
                // fresh one would take; passed, they would wait a lap.
                at_young = !cands.is_empty();
                return !at_young;
            };
            let live = (0..run.len()).filter(|&o| !run.is_dead(o));
            for o in live.take(blocks_per_run) {
                let key = KeyBytes::new(run.key(o), run.long_key(o));
                let sink = candidates_at_most(thr, pi, key.as_ref(), cands);
                self.visit(cx, p, run, o, &guard, sink);
            }
            // A long run's blocks can fill the buffer many times over: the rest of the step
            // waits for the next refill.
            cands.len() < CANDIDATES
        });
        WalkStep {
            pos: stopped as u64,
            visited: (stopped - pos).max(1),
            lapped: stopped >= len,
            at_young,
        }
    }

    /// One step of the walk over partition `p`'s key table from position `at.1` (a
    /// fraction of the table in units of 2^-32: tables are rebuilt at other sizes under the
    /// walk, and a key's home keeps its relative position). Under LFU the victims are the
    /// entries of low counts, new ones among them, which the registry keeps in no useful order
    /// (a new run takes the id its victim freed, just behind the cursor): in key order they
    /// are spread evenly over the lap.
    fn walk_keys(
        &self,
        cx: &mut Cx,
        p: &Partition,
        at: (usize, u64),
        thr: Rank,
        cands: &mut Vec<Victim>,
    ) -> WalkStep {
        const WHOLE: u64 = 1 << 32;
        let guard = epoch::pin();
        let (pi, pos) = at;
        let pos = pos.min(WHOLE);
        let len = p.store.scan_len(&guard);
        let step = ((WALK_STEP as u64) << 32)
            .div_ceil(len.max(1) as u64)
            .min(WHOLE);
        let end = (pos + step).min(WHOLE);
        let first = ((pos as u128 * len as u128) >> 32) as usize;
        let last = ((end as u128 * len as u128) >> 32) as usize;
        p.store.scan(first, last - first, &guard, |digest, run, o| {
            let key = KeyBytes::new(digest, run.long_key(o));
            let sink = candidates_at_most(thr, pi, key.as_ref(), cands);
            self.visit(cx, p, run, o, &guard, sink);
        });
        WalkStep {
            pos: end,
            visited: (last - first).max(1),
            lapped: end >= WHOLE,
            at_young: false,
        }
    }

    // ----------------------------------------------------------------------------------------
    // Exact path

    /// Enumerates the whole non-reserved population and evicts its `need` first entries in the
    /// ideal order. Returns the entries removed.
    fn exact_cap(&self, hand: &mut Hand, cx: &mut Cx, need: i64) -> usize {
        type Full = (
            Rank,
            Arc<str>,
            Arc<str>,
            Arc<str>,
            Arc<str>,
            Vec<u8>,
            ReplicaId,
        );
        let mut all: Vec<(Full, Victim)> = Vec::new();
        {
            let guard = epoch::pin();
            for (pi, p) in hand.parts.iter().enumerate() {
                if !cx.eligible(p) {
                    continue;
                }
                let reps = p.scope.replicas.load(&guard);
                p.store.for_each_key(&guard, |digest, run, o| {
                    let key = KeyBytes::new(digest, run.long_key(o));
                    self.visit(cx, p, run, o, &guard, |rank, rep, generation| {
                        let full = (
                            rank,
                            p.tenant.name.clone(),
                            p.model.name.clone(),
                            p.scheme.clone(),
                            p.adapter.clone(),
                            key.as_ref().to_vec(),
                            reps[rep as usize].name.clone(),
                        );
                        let v = Victim {
                            rank,
                            part: pi,
                            key: own_key(key.as_ref()),
                            rep,
                            generation,
                        };
                        all.push((full, v));
                    });
                });
            }
        }
        all.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let mut removed = 0;
        for (_, v) in &all {
            if removed as i64 >= need
                || self.storage_entries.load(Ordering::Relaxed) <= self.cfg.max_entries
            {
                break;
            }
            let part = &hand.parts[v.part];
            if self.evict_entry(part, v, RANK_MAX, cx, None) {
                removed += 1;
            }
        }
        removed
    }

    /// Enumerates the tenant's keys and deletes its `need` oldest keys in the ideal order.
    fn exact_quota(&self, hand: &mut Hand, cx: &Cx, need: i64) -> usize {
        type Full = (i64, Arc<str>, Arc<str>, Arc<str>, Vec<u8>);
        let mut all: Vec<(Full, usize)> = Vec::new();
        {
            let guard = epoch::pin();
            for (pi, p) in hand.parts.iter().enumerate() {
                if p.keys.load(Ordering::Relaxed) <= 0 {
                    continue;
                }
                p.store.for_each_key(&guard, |digest, run, o| {
                    let full = (
                        run_age(run),
                        p.model.name.clone(),
                        p.scheme.clone(),
                        p.adapter.clone(),
                        KeyBytes::new(digest, run.long_key(o)).as_ref().to_vec(),
                    );
                    all.push((full, pi));
                });
            }
        }
        all.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let mut removed = 0;
        for (full, pi) in all.iter().take(need.max(0) as usize) {
            let part = &hand.parts[*pi];
            if self.evict_key(part, &full.4, i64::MAX, cx.now_us) {
                removed += 1;
                part.tenant.quota_evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        removed
    }

    // ----------------------------------------------------------------------------------------
    // Removal

    /// Removes the cap victim `v` if it is still present with the same generation and its rank
    /// is still ≤ `thr` (re-validated under the partition's writer lock). Counts
    /// `index_evictions{alg, cap}` and emits N1 REMOVED with the removal time. With `mates`,
    /// queues the victim's run mates (see the module docs).
    fn evict_entry(
        &self,
        part: &Partition,
        v: &Victim,
        thr: Rank,
        cx: &mut Cx,
        mates: Option<&mut Vec<Victim>>,
    ) -> bool {
        let alg = cx.alg(self, &part.tenant);
        let key = v.key.as_bytes();
        let (digest, long) = key_parts(key);
        let guard = epoch::pin();
        let mut queued = Vec::new();
        let with_mates = mates.is_some() && alg == Algorithm::Lru;
        let mut pend = Pending::default();
        let mut gone = None;
        let report = part.store.remove_entry_if(
            digest,
            long,
            v.rep,
            &guard,
            |h, run_mates| {
                // Still over the cap? Read under the writer lock, after the victim was chosen: a
                // removal the choice or the lock observed has already lowered the count
                // (removals decrement before entries go, `Index::entry_removed`), so a
                // concurrent PREFIX_EVICTED of another victim never makes the cap take one
                // entry too many (loom m8a).
                let doomed = h.generation() == v.generation
                    && (eff_count(part, digest, h, alg, &guard), h.last_seen_ms()) <= thr
                    && self.storage_entries.load(Ordering::Relaxed) > self.cfg.max_entries;
                // The victim's run mates, read before it goes (re-validated when taken).
                if doomed && with_mates {
                    run_mates.for_each(|mate| {
                        if queued.len() < MAX_MATES {
                            queued.push(Victim {
                                rank: v.rank,
                                part: v.part,
                                key: own_key(mate.as_ref()),
                                rep: v.rep,
                                generation: v.generation,
                            });
                        }
                    });
                }
                doomed
            },
            |h| {
                self.entry_removed(part, key, &h, &guard, &mut pend);
                gone = Some(h);
            },
        );
        let Some(h) = gone else {
            return false;
        };
        pend.keys -= report.keys_removed as i64;
        // Run mates next: the other blocks of the victim's run carry this holder entry (same
        // generation, same `last_seen`), i.e. the same rank under LRU, so they are the next
        // victims in the ideal order (ties) and go first. A chain whose blocks the walk would
        // otherwise find one at a time, across a whole lap, keeps its run alive until the last
        // of them goes; evicted together, it goes at once. (A mate's own mates are already
        // queued: only a victim found otherwise queues them.)
        if let Some(out) = mates {
            out.append(&mut queued);
        }
        cx.settle(self, part, v.rep, pend, &guard);
        cx.evicted[evict_slot(alg, EvictionReason::Cap)] += 1;
        if self.decision_log_installed() {
            let reps = part.scope.replicas.load(&guard);
            self.log_decision(part, key, &reps[v.rep as usize].name, h.last_seen_ms());
        }
        if let Some(s) = self.active_sink(part.tenant.reserved) {
            let reps = part.scope.replicas.load(&guard);
            s.publish(&ChangeEvent {
                kind: ChangeKind::Removed,
                tenant_id: &part.tenant.name,
                model_id: &part.model.name,
                replica_id: &reps[v.rep as usize].name,
                prefix_hash: key,
                adapter_id: &part.adapter,
                timestamp_us: cx.now_us,
            });
        }
        true
    }

    /// Deletes the whole key (every holder) if present and its age is still ≤ `max_age`.
    /// Emits N1 REMOVED per storage entry. Does not count the key (callers do).
    fn evict_key(&self, part: &Partition, key: &[u8], max_age: i64, now_us: i64) -> bool {
        let (digest, long) = key_parts(key);
        let guard = epoch::pin();
        let sink = self.active_sink(part.tenant.reserved);
        let logged = self.decision_log_installed();
        let report = part.store.remove_key_if(
            digest,
            long,
            &guard,
            |holders| key_age(holders) <= max_age,
            |holder| {
                let rep = holder.rep();
                if logged {
                    let reps = part.scope.replicas.load(&guard);
                    self.log_decision(part, key, &reps[rep as usize].name, holder.last_seen_ms());
                }
                let mut pend = Pending::default();
                self.entry_removed(part, key, &holder, &guard, &mut pend);
                self.flush_derived(part, rep, &mut pend, &guard);
                if let Some(s) = &sink {
                    let reps = part.scope.replicas.load(&guard);
                    s.publish(&ChangeEvent {
                        kind: ChangeKind::Removed,
                        tenant_id: &part.tenant.name,
                        model_id: &part.model.name,
                        replica_id: &reps[rep as usize].name,
                        prefix_hash: key,
                        adapter_id: &part.adapter,
                        timestamp_us: now_us,
                    });
                }
            },
        );
        self.drop_keys(part, report.keys_removed, &guard);
        report.keys_removed > 0
    }

    /// Quota `B = 0`: deletes every key of the partition (sliced walk, N1 REMOVED per entry).
    fn remove_all_keys(&self, p: &Partition, cx: &Cx) {
        let sink = self.active_sink(p.tenant.reserved);
        let logged = self.decision_log_installed();
        let report = self.walk_remove(
            p,
            |_| true,
            |key, h| {
                if logged {
                    let guard = epoch::pin();
                    let reps = p.scope.replicas.load(&guard);
                    self.log_decision(p, key, &reps[h.rep() as usize].name, h.last_seen_ms());
                }
                if let Some(s) = &sink {
                    let guard = epoch::pin();
                    let reps = p.scope.replicas.load(&guard);
                    s.publish(&ChangeEvent {
                        kind: ChangeKind::Removed,
                        tenant_id: &p.tenant.name,
                        model_id: &p.model.name,
                        replica_id: &reps[h.rep() as usize].name,
                        prefix_hash: key,
                        adapter_id: &p.adapter,
                        timestamp_us: cx.now_us,
                    });
                }
            },
        );
        p.tenant
            .quota_evictions
            .fetch_add(report.keys_removed as u64, Ordering::Relaxed);
    }
}
