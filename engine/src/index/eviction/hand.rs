//! The victim-selection state a cap or quota keeps between enforcements ([`Hand`]): its
//! partitions, random sequence, sampled threshold, candidate buffer, walk cursor and (cap) the
//! recent-entries ring; the rank the approximate path compares; what an ingest reports to the
//! cap ([`RecentEntry`]). Generic over the partition type, so that the records, which own a
//! hand per tenant, and the hand do not name each other.

use crate::config::Algorithm;
use crate::raw::key::KeyBytesOwned;
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::{Arc, Weak};

/// Comparable prefix of the ideal order used by the approximate path: `(eff_count, last_seen)`.
pub(super) type Rank = (u64, i64);

pub(super) const RANK_MAX: Rank = (u64::MAX, i64::MAX);

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
pub(super) enum Mode {
    /// V2: storage entries of non-reserved tenants.
    Cap,
    /// V5: whole keys of one tenant.
    Quota,
}

/// A new storage entry with an 8-byte key, as an ingest reports it to the cap (see
/// `Index::enforce_cap`): its partition, key, replica and generation.
pub(crate) struct RecentEntry<P> {
    pub(crate) part: PartPtr<P>,
    pub(crate) key: u64,
    pub(crate) rep: u32,
    pub(crate) generation: u32,
}

/// A partition named without a lifetime, for the cap's recent-entries ring, which outlives the
/// ingests that fill it. Whoever dereferences one shows that the partition is not reclaimed yet
/// (an ingest still entered in it, or the ring's clearing by the sweep: see `recent_step`).
pub(crate) struct PartPtr<P>(NonNull<P>);

// Copies name the same partition (derives would ask `P: Copy`).
impl<P> Clone for PartPtr<P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<P> Copy for PartPtr<P> {}
impl<P> Clone for RecentEntry<P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<P> Copy for RecentEntry<P> {}

// SAFETY: a `PartPtr` is a shared reference to a `Partition` (which is `Sync`) without its
// lifetime; sending or sharing it hands over nothing else, and every dereference states why the
// partition is alive.
unsafe impl<P: Sync> Send for PartPtr<P> {}
// SAFETY: as for `Send`: only `&Partition` can be had from it.
unsafe impl<P: Sync> Sync for PartPtr<P> {}

impl<P> PartPtr<P> {
    /// Names `part` without its lifetime.
    pub(crate) fn new(part: &P) -> Self {
        Self(NonNull::from(part))
    }

    /// The partition.
    ///
    /// # Safety
    /// The partition has not been reclaimed, and is not while the reference is used.
    pub(super) unsafe fn get<'a>(self) -> &'a P {
        // SAFETY: (caller) the partition is alive for `'a`.
        unsafe { self.0.as_ref() }
    }
}

/// A candidate victim (cap: one storage entry; quota: one key, `rep`/`generation` unused).
pub(super) struct Victim {
    pub(super) rank: Rank,
    pub(super) part: usize,
    pub(super) key: KeyBytesOwned,
    pub(super) rep: u32,
    pub(super) generation: u32,
}

/// Run mates queued per cap victim at most (longer runs leave the rest to the walk).
pub(super) const MAX_MATES: usize = 256;

/// Victim-selection state (one for the global cap, one per tenant for its quota). Guarded by a
/// mutex: enforcement is serialized per hand, never with readers.
pub(crate) struct Hand<P> {
    pub(super) rng: u64,
    /// Partitions the hand works on (cap: every partition, appended as they are created;
    /// quota: the tenant's partitions, refreshed per enforcement and empty between them).
    pub(super) parts: Vec<Arc<P>>,
    /// Quota only: the partitions of the last enforcement, held weakly until the next one (see
    /// [`Hand::rest`]).
    pub(super) resting: Vec<Weak<P>>,
    pub(super) cum: Vec<i64>,
    pub(super) samples: Vec<Victim>,
    pub(super) cands: Vec<Victim>,
    /// Current threshold (None: estimate before the next walk).
    pub(super) thr: Option<Rank>,
    /// Victims still to take before re-estimating.
    pub(super) budget: u64,
    /// The cursor wrapped around since the last estimate.
    pub(super) lapped: bool,
    /// The last walk found nothing and its runs are to be walked once more with a fresh
    /// threshold (`Index::refill`).
    pub(super) rewalked: bool,
    /// Walk cursor: (partition, position): a run id in its run registry, or, in an LFU
    /// partition, a fraction of its key table (`Index::walk_keys`).
    pub(super) cursor: (usize, u64),
    /// Cap only: new entries of LFU namespaces reported by earlier ingests, oldest first.
    pub(super) recent: VecDeque<RecentEntry<P>>,
    /// The cap's per-enforcement algorithm cache (`Cx::algs`), kept here between
    /// enforcements only for its allocation.
    pub(super) algs: Vec<(usize, Algorithm)>,
}

impl<P> Hand<P> {
    /// A hand with no partitions, its random sequence seeded with `seed`.
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
    pub(crate) fn forget_parts(&mut self, dead: impl Fn(&P) -> bool) {
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

    pub(super) fn next(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.rng)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub(super) fn below(&mut self, n: u64) -> u64 {
        ((self.next() as u128 * n as u128) >> 64) as u64
    }

    pub(super) fn sort_cands(&mut self) {
        // Largest first, so `pop` yields the smallest rank.
        self.cands
            .sort_unstable_by_key(|v| std::cmp::Reverse(v.rank));
    }
}
