//! Global cap (V2) and tenant quotas (V5): victim selection and removal (D6).
//!
//! The room's files: `hand.rs` (the victim-selection state a cap or quota keeps between
//! enforcements), `context.rs` (one enforcement's context and the ranks it reads), `enforce.rs`
//! (the entry points an ingest calls, and the removal of a chosen victim), `walk.rs` (the
//! approximate path: sampling, the walk, the recent-entries feed) and `exact.rs` (the exact path
//! for small populations). This file holds the reasons, the counters' slots and the tuning
//! constants.
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
//!    `last_seen` (`raw/run_ids.rs`, `RunIds`), so with a
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
//!    [`MAX_MATES`](hand::MAX_MATES)) as the next candidates. They carry the same holder entry —
//!    the victim's replica with the same `last_seen` and generation, so tied with it in the ideal
//!    order — and are taken while the index is still over the cap, each re-validated like any
//!    candidate (present, same generation, rank ≤ threshold). A chain thus leaves whole, and its
//!    run with it, instead of block by block over a lap of the walk (test
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
//! **Counters.** The cap runs holding the calling ingest's key and entry deltas
//! ([`HeldBackDeltas`](super::counters::HeldBackDeltas)): a victim of the same partition folds its
//! own deltas into them (and of the same replica, its entry and serving deltas too), and the sum is
//! applied once at the end, so an insert and its victim in one namespace touch no shared counter
//! but the entry count, which removals lower at once, before the unlink (loom m8a). The partition
//! weights of the sampling count the held entries; eviction counts are summed per enforcement.

mod context;
mod enforce;
mod exact;
mod hand;
mod walk;

pub(crate) use hand::{Hand, PartPtr, RecentEntry, seed_of};

use crate::config::Algorithm;

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
pub(super) const SAMPLES: usize = 64;
/// Slot probes per estimate before giving up on finding [`SAMPLES`] keys.
pub(super) const SAMPLE_ATTEMPTS: usize = SAMPLES * 16;
/// Index of the threshold in the sorted samples (the 4th smallest of 64: ≈ 6% quantile; see
/// the module docs for the quality / cost trade-off).
pub(super) const THRESHOLD_RANK: usize = 3;
/// Threshold index when every sample has the same `eff_count` (LRU, or LFU with nothing
/// credited): the order is by age alone and the 6th smallest (≈ 9% quantile) keeps walks short;
/// with mixed counts a looser threshold would admit credited entries while uncredited ones
/// remain.
pub(super) const THRESHOLD_RANK_BY_AGE: usize = 5;
/// Threshold index for quotas (always by age): the 4th smallest (≈ 6%). The quota has no cost
/// bar; at the 7th smallest the worst N/2 quality of 240 runs (60 processes × 4 seeds) was at
/// the edge of V5's 95% (94.96–95.65%), at the 4th 96.79%.
pub(super) const THRESHOLD_RANK_QUOTA: usize = 3;
/// Candidate buffer size.
pub(super) const CANDIDATES: usize = 32;
/// Recent new entries the cap remembers (LFU namespaces only), oldest dropped first.
pub(super) const RECENT_RING: usize = 1024;
/// Ring entries examined per step before falling back to the buffer.
pub(super) const RECENT_TRIES: usize = 4;
/// Registry entries a refill walks at most.
pub(super) const WALK_BUDGET: usize = 8192;
/// Registry entries scanned per step of a walk.
pub(super) const WALK_STEP: usize = 512;
