//! Published cache events (E1–E7): PREFIX_EVICTED removes a replica's entries of the named
//! keys, ALL_CLEARED all of a replica's entries (both through the (tenant, model) pair's
//! partition list), REPLICA_UPDATED refreshes a replica's stats clock; PREFIX_ADDED and unknown
//! types are ignored. Events never run quota or cap enforcement (E7).

use super::counters::Pending;
use super::records::{ModelRec, Partition};
use super::{Index, STATS_RECORD_BYTES};
use crate::clock::us_to_ms;
use crate::raw::key::{Keys, digest};
use crate::sink::{ChangeEvent, ChangeKind};
use crate::sync::Ordering;
use crate::types::*;
use crossbeam_epoch as epoch;
use std::sync::{Arc, Weak};

impl Index {
    /// Applies one published `CacheEvent` (E1–E6). Never runs quota or cap enforcement (E7).
    pub fn apply_event(&self, ev: CacheEventInput<'_>) {
        let t = ev.tenant_id;
        let m = ev.model_id;
        match ev.event_type {
            event_type::PREFIX_EVICTED => self.evict_prefix(&ev),
            event_type::REPLICA_UPDATED => {
                let ts_us = self.resolve_now_us(ev.timestamp_us);
                let ts_ms = us_to_ms(ts_us);
                let guard = epoch::pin();
                let Some(model) = self.model_ref(t, m, &guard) else {
                    return;
                };
                let refreshed = model.stats.update(|v| {
                    match v.binary_search_by(|r| (*r.replica).cmp(ev.replica_id)) {
                        Ok(i) => {
                            let mut v2 = v.clone();
                            v2[i].last_seen_ms = v2[i].last_seen_ms.max(ts_ms);
                            (Some(v2), true)
                        }
                        Err(_) => (None, false),
                    }
                });
                if refreshed && let Some(s) = self.active_sink(model.tenant.reserved) {
                    s.publish(&ChangeEvent {
                        kind: ChangeKind::Stats,
                        tenant_id: t,
                        model_id: m,
                        replica_id: ev.replica_id,
                        prefix_hash: &[],
                        adapter_id: "",
                        timestamp_us: ts_us,
                    });
                }
            }
            event_type::ALL_CLEARED => self.clear_replica(&ev),
            _ => {} // E5 PREFIX_ADDED, E6 unknown
        }
    }

    /// E3, cost O(partitions of (tenant, model) + matches).
    fn evict_prefix(&self, ev: &CacheEventInput<'_>) {
        if ev.prefix_hash.is_empty() {
            return; // D8
        }
        self.evict_prefixes(
            ev.tenant_id,
            ev.model_id,
            ev.replica_id,
            ev.adapter_id,
            std::slice::from_ref(&ev.prefix_hash),
            ev.timestamp_us,
        );
    }

    /// Batch E3: the effect of one PREFIX_EVICTED event per key of `prefix_hashes` (same
    /// tenant, model, replica, adapter filter and timestamp), resolving the pair, its partitions
    /// and the replica index once. Empty keys are skipped (D8). Change notifications (N1) are
    /// published per removed entry, partition by partition. Returns the entries removed.
    pub fn evict_prefixes<H: AsRef<[u8]>>(
        &self,
        tenant_id: &str,
        model_id: &str,
        replica_id: &str,
        adapter_id: &str,
        prefix_hashes: &[H],
        timestamp_us: i64,
    ) -> u64 {
        let guard = epoch::pin();
        let Some(model) = self.model_ref(tenant_id, model_id, &guard) else {
            return 0;
        };
        let ts_us = self.resolve_now_us(timestamp_us);
        let sink = self.active_sink(model.tenant.reserved);
        // D8: empty keys name nothing. The named keys and their digests, the same for every
        // partition: on the stack for a chain of up to `INLINE` keys (a PREFIX_EVICTED per
        // chain is the common case), else on the heap.
        const INLINE: usize = 64;
        let mut named_inline: [&[u8]; INLINE] = [&[]; INLINE];
        let mut digests_inline = [0u64; INLINE];
        let (mut named_heap, mut digests_heap) = (Vec::new(), Vec::new());
        let (named, digests): (&[&[u8]], &[u64]) = if prefix_hashes.len() <= INLINE {
            let mut n = 0;
            for h in prefix_hashes.iter().map(AsRef::as_ref) {
                if !h.is_empty() {
                    (named_inline[n], digests_inline[n]) = (h, digest(h));
                    n += 1;
                }
            }
            (&named_inline[..n], &digests_inline[..n])
        } else {
            named_heap.extend(
                prefix_hashes
                    .iter()
                    .map(AsRef::as_ref)
                    .filter(|h| !h.is_empty()),
            );
            digests_heap.extend(named_heap.iter().map(|h| digest(h)));
            (&named_heap, &digests_heap)
        };
        let long = named.iter().any(|h| h.len() != 8);
        let mut removed = 0u64;
        self.for_each_part(model, |p| {
            if !adapter_id.is_empty() && *p.adapter != *adapter_id {
                return;
            }
            let Some(rep) = p.scope.enter_existing(replica_id) else {
                return;
            };
            let mut pend = Pending::default();
            let keys = match Keys::with_bytes(digests, named) {
                Some(keys) if long => keys,
                _ => Keys::eight(digests),
            };
            let report = p.store.evict_with(keys, rep, &guard, |i, h| {
                self.entry_removed(p, named[i], &h, &guard, &mut pend);
                removed += 1;
                if let Some(s) = &sink {
                    s.publish(&ChangeEvent {
                        kind: ChangeKind::Removed,
                        tenant_id,
                        model_id,
                        replica_id,
                        prefix_hash: named[i],
                        adapter_id: &p.adapter,
                        timestamp_us: ts_us,
                    });
                }
            });
            pend.keys -= report.keys_removed as i64;
            // Counters once per partition (they may lag the batch, exact after it, C3).
            self.flush_pending(p, rep, &mut pend, &guard);
            p.scope.exit(rep);
        });
        removed
    }

    /// Calls `f` on every partition of a (tenant, model) pair, without allocating for ≤ 8. The
    /// partitions are upgraded from the pair's (weak) list under its lock and held across the
    /// calls: one the sweep reclaims meanwhile stays valid (and empty) until they end.
    fn for_each_part(&self, model: &ModelRec, mut f: impl FnMut(&Partition)) {
        const N: usize = 8;
        let mut small: [Option<Arc<Partition>>; N] = Default::default();
        let mut big: Vec<Arc<Partition>> = Vec::new();
        {
            let list = model.parts();
            if list.len() <= N {
                for (slot, part) in small.iter_mut().zip(list.iter()) {
                    *slot = part.upgrade();
                }
            } else {
                big.extend(list.iter().filter_map(Weak::upgrade));
            }
        }
        for p in small.iter().flatten().chain(big.iter()) {
            f(p);
        }
    }

    /// E4: sliced walk over the pair's partitions; never blocks readers or other pairs.
    fn clear_replica(&self, ev: &CacheEventInput<'_>) {
        let ts_us = self.resolve_now_us(ev.timestamp_us);
        let reserved = self.is_reserved(ev.tenant_id);
        if let Some(model) = self.model_arc(ev.tenant_id, ev.model_id) {
            let parts: Vec<Arc<Partition>> =
                model.parts().iter().filter_map(Weak::upgrade).collect();
            for p in parts.iter() {
                let Some(rep) = p.scope.enter_existing(ev.replica_id) else {
                    continue;
                };
                self.walk_remove(p, |h| h.rep() == rep, |_, _| {});
                p.scope.exit(rep);
            }
            let removed = model.stats.update(|v| {
                match v.binary_search_by(|r| (*r.replica).cmp(ev.replica_id)) {
                    Ok(i) => {
                        let mut v2 = v.clone();
                        v2.remove(i);
                        (Some(v2), true)
                    }
                    Err(_) => (None, false),
                }
            });
            if removed {
                self.stats_bytes
                    .fetch_sub(STATS_RECORD_BYTES, Ordering::Relaxed);
            }
        }
        if let Some(s) = self.active_sink(reserved) {
            s.publish(&ChangeEvent {
                kind: ChangeKind::Cleared,
                tenant_id: ev.tenant_id,
                model_id: ev.model_id,
                replica_id: ev.replica_id,
                prefix_hash: &[],
                adapter_id: "",
                timestamp_us: ts_us,
            });
        }
    }
}
