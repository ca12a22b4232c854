//! The entry points an ingest calls (the cap, V2; a tenant's quota, V5) and the removal of a
//! chosen victim, re-validated under its partition's writer lock.

use super::super::Index;
use super::super::counters::{HeldBackDeltas, Pending};
use super::super::records::{Partition, TenantRec};
use super::context::{Cx, eff_count, key_age};
use super::hand::{Hand, MAX_MATES, Mode, Rank, RecentEntry, Victim, seed_of};
use super::*;
use crate::config::Algorithm;
use crate::raw::key::key_parts;
use crate::raw::key::own_key;
use crate::sink::{ChangeEvent, ChangeKind};
use crate::sync::Ordering;
use crossbeam_epoch::{self as epoch};
use std::sync::Weak;

impl Index {
    /// Whether a cap is set and the non-reserved entries exceed it.
    pub(in crate::index) fn over_cap(&self) -> bool {
        let cap = self.cfg.max_entries;
        cap > 0 && self.storage_entries.load(Ordering::Relaxed) > cap
    }

    /// V2: while `effective = storage_entries − reserved_storage_entries > cap`, remove victims.
    /// (`storage_entries` already excludes reserved tenants, K15.) `created` are some of the
    /// entries the calling ingest just created; when the index is over the cap, those of LFU
    /// namespaces join the recent-entries ring *after* this enforcement, so an entry is never a
    /// ring victim of its own ingest.
    pub(in crate::index) fn enforce_cap(
        &self,
        created: &[Option<RecentEntry<Partition>>],
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
    pub(in crate::index) fn enforce_quota(
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
        // The hand is made at the tenant's first enforcement: most tenants never reach their
        // quota, and an unused hand was ~250 bytes of every tenant record (issue 42).
        let mut hand_slot = tr
            .quota_hand
            .get_or_make(|| {
                crate::sync::Mutex::new(Hand::new(seed_of(
                    self.cfg.eviction_seed,
                    crate::directory::hash_strs(&[t]),
                )))
            })
            .lock();
        let hand: &mut Hand<Partition> = &mut hand_slot;
        let before = hand.resting.len();
        hand.resting.clear();
        hand.parts.clear();
        for m in tr.models.lock().iter().filter_map(Weak::upgrade) {
            hand.parts
                .extend(m.parts().iter().filter_map(Weak::upgrade));
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

    /// Removes the cap victim `v` if it is still present with the same generation and its rank
    /// is still ≤ `thr` (re-validated under the partition's writer lock). Counts
    /// `index_evictions{alg, cap}` and emits N1 REMOVED with the removal time. With `mates`,
    /// queues the victim's run mates (see the module docs).
    pub(super) fn evict_entry(
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
    pub(super) fn evict_key(
        &self,
        part: &Partition,
        key: &[u8],
        max_age: i64,
        now_us: i64,
    ) -> bool {
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
    pub(super) fn remove_all_keys(&self, p: &Partition, cx: &Cx) {
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
