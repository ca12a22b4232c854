//! Derived counters (C3): the key, entry and serving counts a write changes are not touched per
//! block. Their deltas collect in a [`Pending`] per (partition, replica) run of an ingest,
//! a removal or an eviction batch and are applied once, after the entries are published, so
//! they may lag an in-flight write and are exact once writes quiesce. [`HeldBackDeltas`] carries
//! an ingest's last run through its quota and cap enforcement (see `eviction/`).

use super::Index;
use super::records::Partition;
use crate::sync::Ordering;
use crossbeam_epoch::{self as epoch, Guard};

/// Derived counter deltas of an ingest not yet applied (see `Index::flush_pending`).
#[derive(Default)]
pub(super) struct Pending {
    pub(super) keys: i64,
    pub(super) entries: i64,
    /// New entries not yet added to the index-wide entry count. (Removals are subtracted from
    /// it at once, before the unlink: see `Index::remove_holder`.)
    pub(super) added: i64,
    /// The first few new entries with 8-byte keys: `(key, generation)`, for the cap's
    /// recent-entries feed (see `eviction/`).
    pub(super) created: [(u64, u32); RECENT_PER_RUN],
    pub(super) n_created: usize,
}

impl Pending {
    /// Notes a new entry for the cap's recent-entries feed (the first few with 8-byte keys).
    #[inline]
    pub(super) fn note_created(&mut self, key: &[u8], generation: u32) {
        if self.n_created < RECENT_PER_RUN
            && let Ok(k) = <[u8; 8]>::try_from(key)
        {
            self.created[self.n_created] = (u64::from_be_bytes(k), generation);
            self.n_created += 1;
        }
    }
}

/// The key and entry deltas of an ingest's last (partition, replica) run, held back until its
/// quota and cap enforcement are done (its new entries are already in the entry count). A cap
/// victim of the same partition folds its own deltas in instead of applying them, so at the cap
/// an ingest and its victim in one namespace mostly cancel and touch no shared counter but the
/// entry count. Until the flush, the partition's counters lag by at most this one ingest (C3);
/// the enforcement that holds the carry accounts for it where it reads them.
pub(super) struct HeldBackDeltas<'a> {
    pub(super) part: &'a Partition,
    pub(super) rep: u32,
    pub(super) pend: Pending,
}

impl HeldBackDeltas<'_> {
    /// Applies the held-back deltas.
    pub(super) fn apply(mut self, ix: &Index) {
        let guard = epoch::pin();
        ix.flush_derived(self.part, self.rep, &mut self.pend, &guard);
    }
}

/// New entries of one (partition, replica) run an ingest reports to the cap.
pub(super) const RECENT_PER_RUN: usize = 4;

impl Index {
    /// Applies the derived counter deltas of one (partition, replica) run of upserts.
    pub(super) fn flush_pending(
        &self,
        part: &Partition,
        rep: u32,
        pend: &mut Pending,
        guard: &Guard,
    ) {
        self.flush_added(part, pend);
        self.flush_derived(part, rep, pend, guard);
    }

    /// Applies `pend`'s new entries to the index-wide entry count.
    pub(super) fn flush_added(&self, part: &Partition, pend: &mut Pending) {
        let added = std::mem::take(&mut pend.added);
        if added != 0 {
            if part.tenant.reserved {
                self.reserved_entries.fetch_add(added, Ordering::Relaxed);
            } else {
                self.storage_entries.fetch_add(added, Ordering::Relaxed);
            }
        }
    }

    /// Applies `pend`'s key and entry deltas (key counts, partition entries, serving).
    pub(super) fn flush_derived(
        &self,
        part: &Partition,
        rep: u32,
        pend: &mut Pending,
        guard: &Guard,
    ) {
        let keys = std::mem::take(&mut pend.keys);
        let entries = std::mem::take(&mut pend.entries);
        if keys != 0 {
            part.keys.fetch_add(keys, Ordering::Relaxed);
            part.tenant.keys.fetch_add(keys, Ordering::Relaxed);
            part.model.keys.fetch_add(keys, Ordering::Relaxed);
            self.total_keys.fetch_add(keys, Ordering::Relaxed);
            if !part.tenant.reserved {
                part.model.gauge.keys.fetch_add(keys, Ordering::Relaxed);
            }
        }
        if entries != 0 {
            part.entries.fetch_add(entries, Ordering::Relaxed);
            Self::serving_add(part, rep, entries, guard);
        }
    }

    /// Adds `delta` to `serving[scope][rep]`, maintaining `serving_n` by threshold crossings
    /// (each fetch_add sees an exact old value, so crossings telescope: `serving_n` is exact once
    /// writes quiesce even though batched deltas may make a count transiently negative).
    fn serving_add(part: &Partition, rep: u32, delta: i64, guard: &Guard) {
        let reps = part.scope.replicas.load(guard);
        // AcqRel: a removal's unlinks happen before its decrement, and the sweep reads the
        // count with Acquire before it recycles the slot (`ScopeRec::reclaim_slots`).
        let old = reps[rep as usize]
            .serving
            .fetch_add(delta, Ordering::AcqRel);
        let new = old + delta;
        if old <= 0 && new > 0 {
            part.scope.serving_n.fetch_add(1, Ordering::Relaxed);
        } else if old > 0 && new <= 0 {
            part.scope.serving_n.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
