//! Removal of one entry (a holder of a key) and the sliced walk that removes the holders a
//! predicate selects; shared by events, the sweep and eviction.
//!
//! The index-wide entry count drops before the unlink (loom m8a), and an entry's LFU cell goes
//! with it (V3), taking its share out of the key's hot-access sum (D4).

use super::ingest::{Pending, with_holders_removed};
use super::records::{ModelRec, Partition};
use super::{Index, SLICE};
use crate::raw::lfu::KeyAccessSum;
use crate::raw::node::{Holder, KeyNode};
use crate::raw::table::SHARDS;
use crate::raw::writer::ShardWriter;
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

    /// Removes replica `rep` from the key at slot `i` (node `node`). Returns the removed holder.
    /// Allocates nothing but the replacement node (if other holders remain). Key / entry /
    /// serving counter deltas go to `pend`; the caller flushes them with
    /// [`Index::flush_pending`] for `(part, rep)`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn remove_holder(
        &self,
        w: &mut ShardWriter<'_>,
        part: &Partition,
        i: usize,
        node: &KeyNode,
        rep: u32,
        guard: &Guard,
        pend: &mut Pending,
    ) -> Option<Holder> {
        let hs = node.holders();
        let pos = hs.iter().position(|h| h.rep() == rep)?;
        let h = hs[pos];
        // The index-wide entry count drops *before* the unlink: whoever observes the unlink
        // (a cap enforcement that enumerated or locked this key) then also reads the lower
        // count, so the cap never evicts for an entry that is already gone (loom m8a). The
        // count may briefly run below the population, which only delays a trim (C3).
        if part.tenant.reserved {
            self.reserved_entries.fetch_sub(1, Ordering::Relaxed);
        } else {
            self.storage_entries.fetch_sub(1, Ordering::Relaxed);
        }
        if hs.len() == 1 {
            w.remove(i, guard);
            pend.keys -= 1;
        } else {
            with_holders_removed(&hs, pos, |buf| w.replace(i, buf, None, guard));
        }
        // LFU state is lost on delete (V3); an LRU-only shard has none.
        if w.has_lfu()
            && let Some((base, ks)) = w.lfu_kill(node.key(), rep, h.generation(), guard)
            && base > 0
        {
            // The cell added min(base, threshold) to the key sum (see `table::LfuCell`).
            let contribution = base.min(self.hot_threshold());
            self.add_key_access(&part.model, ks, -(contribution as i64));
        }
        pend.entries -= 1;
        Some(h)
    }

    /// Walks every key of `part` in slices of ≤ [`SLICE`] slots per shard lock, removing holders
    /// selected by `select`; `on_removed` is called (outside no lock guarantee) per removal.
    pub(super) fn walk_remove(
        &self,
        part: &Partition,
        mut select: impl FnMut(&Holder) -> bool,
        mut on_removed: impl FnMut(&KeyNode, &Holder),
    ) -> u64 {
        let mut removed = 0u64;
        for s in 0..SHARDS {
            let mut start = 0usize;
            let Some(mut w) = part.table.writer_if_created(s) else {
                continue;
            };
            let mut rb = w.rebuilds();
            loop {
                let guard = epoch::pin();
                let cap = w.capacity(&guard);
                let end = (start + SLICE).min(cap);
                for i in start..end {
                    while let Some(node) = w.node_at(i, &guard) {
                        let Some(h) = node.holders().iter().find(|h| select(h)).copied() else {
                            break;
                        };
                        on_removed(node, &h);
                        let mut pend = Pending::default();
                        self.remove_holder(&mut w, part, i, node, h.rep(), &guard, &mut pend);
                        self.flush_pending(part, h.rep(), &mut pend, &guard);
                        removed += 1;
                    }
                }
                drop(guard);
                if end >= cap {
                    break;
                }
                start = end;
                drop(w);
                w = part
                    .table
                    .writer_if_created(s)
                    .expect("a created shard lives as long as its table");
                if w.rebuilds() != rb {
                    rb = w.rebuilds();
                    start = 0;
                }
            }
            let guard = epoch::pin();
            w.maybe_shrink(&guard);
        }
        removed
    }
}

#[cfg(test)]
mod tests {
    use crate::index::testing::{NOW, all_cleared, chain, index_at_now};
    use crate::types::*;

    /// Walks that remove (the sweep's TTL pass, ALL_CLEARED, PREFIX_EVICTED) visit only the
    /// shards a writer created: a one-key partition keeps its one shard. (They used to create
    /// all sixteen: a sweep over 100,000 one-entry tenants took the server from 340 MB to
    /// 1.4 GB of RSS while it reclaimed them.)
    #[test]
    fn removal_walks_create_no_shards() {
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
        assert_eq!(ix.memory_bytes(), held, "no shard was created");
        assert_eq!(ix.storage_entries(), 1);
    }
}
