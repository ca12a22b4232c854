//! What every removal does per entry it removes, and the walk that removes the holders a
//! predicate selects; shared by events, the sweep and eviction.
//!
//! The run store calls back per removed entry before readers can see it gone
//! (`raw/run_store/`), so the index-wide entry count drops before the unlink (loom m8a), and
//! an entry's LFU cell goes with it (V3), taking its share out of the key's hot-access sum
//! (D4).

use super::Index;
use super::counters::Pending;
use super::records::{ModelRec, Partition};
use crate::raw::holder::Holder;
use crate::raw::key::KeyBytes;
use crate::raw::lfu::KeyAccessSum;
use crate::raw::run_store::EvictReport;
use crate::sync::Ordering;
use crossbeam_epoch::{self as epoch, Guard};

impl Index {
    /// The hot access threshold (D4), ≥ 1.
    #[inline]
    pub(super) fn hot_threshold(&self) -> u64 {
        u64::from(self.cfg.hot_access_threshold.max(1))
    }

    /// Adds `delta` to a key sum, which holds Σ min(count, threshold) over the key's cells: the
    /// key is hot exactly when that reaches the threshold (if one cell reaches it alone, the
    /// sum does; otherwise every term is the count itself).
    pub(super) fn add_key_access(&self, model: &ModelRec, ks: &KeyAccessSum, delta: i64) {
        let thr = self.hot_threshold() as i64;
        let old = ks.sum.fetch_add(delta, Ordering::AcqRel);
        let new = old + delta;
        if old < thr && new >= thr {
            model.hot.fetch_add(1, Ordering::Relaxed);
        } else if old >= thr && new < thr {
            model.hot.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Accounts for the removal of `holder`'s entry of `key` from `part` (called by the run
    /// store before the entry goes): the index-wide entry count at once, the entry's LFU
    /// cell, and its derived deltas into `pend` (for `(part, holder.rep())`).
    pub(super) fn entry_removed(
        &self,
        part: &Partition,
        key: &[u8],
        holder: &Holder,
        guard: &Guard,
        pend: &mut Pending,
    ) {
        // The index-wide entry count drops *before* the unlink: whoever observes the unlink
        // (a cap enforcement that enumerated or locked this key) then also reads the lower
        // count, so the cap never evicts for an entry that is already gone (loom m8a). The
        // count may briefly run below the population, which only delays a trim (C3).
        if part.tenant.reserved {
            self.reserved_entries.fetch_sub(1, Ordering::Relaxed);
        } else {
            self.storage_entries.fetch_sub(1, Ordering::Relaxed);
        }
        // LFU state is lost on delete (V3); a partition never credited has none.
        if let Some((base, ks)) = part.lfu.kill(key, holder.rep(), holder.generation(), guard)
            && base > 0
        {
            // The cell added min(base, threshold) to the key sum (see `raw::lfu::LfuCell`).
            let contribution = base.min(self.hot_threshold());
            self.add_key_access(&part.model, ks, -(contribution as i64));
        }
        pend.entries -= 1;
    }

    /// Removes from every key of `part` the holders `select` picks; `on_removed(key, holder)` is
    /// called per removal (under the partition's writer lock, before the entry goes). Returns
    /// the entries and keys removed.
    pub(super) fn walk_remove(
        &self,
        part: &Partition,
        select: impl Fn(&Holder) -> bool,
        mut on_removed: impl FnMut(&[u8], &Holder),
    ) -> EvictReport {
        let guard = epoch::pin();
        let report = part
            .store
            .remove_holders_with(select, &guard, |digest, long, h| {
                let key = KeyBytes::new(digest, long);
                on_removed(key.as_ref(), &h);
                let mut pend = Pending::default();
                self.entry_removed(part, key.as_ref(), &h, &guard, &mut pend);
                self.flush_derived(part, h.rep(), &mut pend, &guard);
            });
        self.drop_keys(part, report.keys_removed, &guard);
        report
    }

    /// Applies `n` keys' removal to the key counts of `part`.
    pub(super) fn drop_keys(&self, part: &Partition, n: usize, guard: &Guard) {
        if n > 0 {
            let mut pend = Pending {
                keys: -(n as i64),
                ..Default::default()
            };
            // No entry deltas: any replica index will do.
            self.flush_derived(part, 0, &mut pend, guard);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::index::testing::{NOW, all_cleared, chain, index_at_now};
    use crate::types::*;

    /// Walks that remove (the sweep's TTL pass, ALL_CLEARED, PREFIX_EVICTED) allocate nothing
    /// that stays: a one-key partition keeps its size. (A walk that created per-partition state
    /// once took the server from 340 MB to 1.4 GB of RSS while a sweep over 100,000 one-entry
    /// tenants reclaimed them.)
    #[test]
    fn removal_walks_create_nothing() {
        let ix = index_at_now();
        chain(&ix, "a", &[*b"key-0001"]);
        let held = ix.memory_bytes();
        all_cleared(&ix, "b");
        ix.apply_event(CacheEventInput {
            event_type: crate::types::event_type::PREFIX_EVICTED,
            replica_id: "a",
            model_id: "m",
            tenant_id: "t",
            prefix_hash: b"not-a-key",
            timestamp_us: NOW,
            adapter_id: "",
        });
        ix.sweep_now();
        assert_eq!(ix.memory_bytes(), held, "nothing was allocated");
        assert_eq!(ix.storage_entries(), 1);
    }
}
