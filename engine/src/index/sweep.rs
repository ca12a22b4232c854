//! The TTL sweep (V1) and the index's lifecycle: the sweep removes expired entries and stats
//! records slice by slice, then reclaims the records that hold nothing (children first, under
//! the record lock, freed through the epoch); `start` runs it on a std ticker thread.

use super::eviction::{EvictionReason, evict_slot};
use super::records::{ModelRec, Partition, StatsRecord, TenantRec};
use super::{Index, STATS_RECORD_BYTES, Ticker};
use crate::clock::us_to_ms;
use crate::config::Algorithm;
use crate::directory::hash_strs;
use crate::sink::{ChangeEvent, ChangeKind};
use crate::sync::{Condvar, Mutex, Ordering};
use crossbeam_epoch as epoch;
use std::sync::{Arc, Weak};

/// What a sweep removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepOutcome {
    /// Storage entries removed.
    pub entries_removed: u64,
    /// Stats records removed.
    pub stats_removed: u64,
    /// Records reclaimed because they held nothing: partitions, scopes, (tenant, model) pairs,
    /// per-model gauges and tenants.
    pub records_reclaimed: u64,
    /// Scope replica slots reclaimed (replicas that held no entry in their scope).
    pub replica_slots_reclaimed: u64,
    /// Key-table segments rebuilt smaller (removals leave that to the sweep).
    pub segments_shrunk: u64,
}

/// Drives the epoch's collector after every sweep, so that what the sweep unlinked (reclaimed
/// records with their key tables, removed runs, retired segment tables and directory tables)
/// is freed now. The collector otherwise runs a few bags every 128 pins of some thread: after
/// a churn wave the index goes quiet, and the garbage of every expired identity (~4 KiB a
/// partition) would stay allocated until traffic returned (issue 42). One flush per 64
/// objects the sweep unlinked (a flush runs up to eight bags of up to 64: eight times what
/// is needed when every flush advances the epoch), plus four that also let the epoch advance
/// past pins that held it back at an earlier sweep (what they protected is freed now). A
/// flush with nothing to run is a pin and an epoch check (tens of nanoseconds).
fn collect_garbage(out: &SweepOutcome) {
    let unlinked = out.entries_removed
        + out.stats_removed
        + out.records_reclaimed
        + out.replica_slots_reclaimed
        + out.segments_shrunk;
    for _ in 0..4 + unlinked.div_ceil(64) {
        epoch::pin().flush();
    }
}

impl Index {
    /// Runs one TTL sweep now (V1). Sliced: ≤ [`SLICE`](super::SLICE) slots per hold of a
    /// partition's writer lock.
    pub fn sweep_now(&self) -> SweepOutcome {
        let out = self.sweep_locked();
        collect_garbage(&out);
        out
    }

    /// [`Index::sweep_now`] under the sweep lock, before the collector's drive.
    fn sweep_locked(&self) -> SweepOutcome {
        let _l = self.sweep_lock.lock();
        // Entries expire here only when this index decides its evictions (`replicate.rs`).
        let local = self.local_eviction();
        let t_us = self.clock.now_us();
        let t_ms = us_to_ms(t_us);
        let mut out = SweepOutcome::default();
        // A tenant's TTL and algorithm, resolved again only when the tenant changes from one
        // record to the next: a map over every tenant would cost the sweep memory in
        // proportion to the tenants at the very moment a churn wave peaks.
        let mut last_policy: Option<(*const TenantRec, (i64, Algorithm))> = None;
        let mut policy_of = |tenant: &Arc<TenantRec>| match last_policy {
            Some((seen, policy)) if seen == Arc::as_ptr(tenant) => policy,
            _ => {
                let policy = (
                    self.ttl_for(&tenant.name),
                    self.resolvers.algorithm(&tenant.name),
                );
                last_policy = Some((Arc::as_ptr(tenant), policy));
                policy
            }
        };
        let parts: Vec<Arc<Partition>> = self.all_parts.lock().clone();
        for p in parts.iter() {
            let (ttl, alg) = policy_of(&p.tenant);
            if ttl <= 0 || !local {
                continue;
            }
            let sink = self.active_sink(p.tenant.reserved);
            let logged = self.decision_log_installed();
            let n = self
                .walk_remove(
                    p,
                    |h| t_ms - h.last_seen_ms() >= ttl,
                    |key, h| {
                        if sink.is_some() || logged {
                            let guard = epoch::pin();
                            let reps = p.scope.replicas.load(&guard);
                            if let Some(rr) = reps.get(h.rep() as usize) {
                                if let Some(s) = &sink {
                                    s.publish(&ChangeEvent {
                                        kind: ChangeKind::Removed,
                                        tenant_id: &p.tenant.name,
                                        model_id: &p.model.name,
                                        replica_id: &rr.name,
                                        prefix_hash: key,
                                        adapter_id: &p.adapter,
                                        timestamp_us: t_us,
                                    });
                                }
                                self.log_decision(p, key, &rr.name, h.last_seen_ms());
                            }
                        }
                    },
                )
                .removed as u64;
            out.entries_removed += n;
            self.evictions[evict_slot(alg, EvictionReason::Ttl)].fetch_add(n, Ordering::Relaxed);
        }
        // Removals (events, this TTL pass, cap evictions) never shrink a key table: its
        // segments that fell below 1/8 live are rebuilt here, whatever the tenant's TTL.
        let guard = epoch::pin();
        for p in parts.iter() {
            out.segments_shrunk += p.store.shrink(&guard) as u64;
        }
        drop(guard);
        let models: Vec<Arc<ModelRec>> = self.all_models.lock().clone();
        for m in models.iter() {
            let (ttl, _) = policy_of(&m.tenant);
            let removed = m.stats.update(|v| {
                if v.iter().any(|s| t_ms - s.last_seen_ms >= ttl) {
                    let v2: Vec<StatsRecord> = v
                        .iter()
                        .filter(|s| t_ms - s.last_seen_ms < ttl)
                        .cloned()
                        .collect();
                    let n = v.len() - v2.len();
                    (Some(v2), n)
                } else {
                    (None, 0)
                }
            });
            out.stats_removed += removed as u64;
            self.stats_bytes
                .fetch_sub(STATS_RECORD_BYTES * removed as i64, Ordering::Relaxed);
        }
        drop(models);
        drop(parts);
        self.reclaim(&mut out);
        out
    }

    /// Reclaims every record that holds nothing (sweep; see `dir::Life` for the protocol),
    /// children first, under the record lock: partitions with no key and no entry, replica
    /// slots whose replica holds no entry in its scope, scopes with no partition, (tenant,
    /// model) pairs with no partition and no stats record, gauges of no pair, tenants with no
    /// pair. Each unlinked record is freed through the epoch, so readers that resolved it
    /// keep a valid (empty) record until they unpin; writers that find it retired resolve
    /// again and create a new one.
    fn reclaim(&self, out: &mut SweepOutcome) {
        let _records = self.records.lock();
        let mut gone_parts: Vec<Arc<Partition>> = Vec::new();
        {
            // The cap hand's list is a prefix of `all_parts` (it appends what it lacks): both
            // lose the same partitions while the hand is locked, so that stays true.
            let mut cap_hand = self.cap_hand.lock();
            let mut all = self.all_parts.lock();
            all.retain(|p| {
                let empty = |p: &Partition| {
                    p.keys.load(Ordering::Acquire) == 0 && p.entries.load(Ordering::Acquire) == 0
                };
                if !empty(p) || !p.life.try_retire() {
                    return true;
                }
                if !empty(p) {
                    p.life.revive();
                    return true;
                }
                gone_parts.push(p.clone());
                false
            });
            self.all_parts_len.store(all.len(), Ordering::Release);
            if !gone_parts.is_empty() {
                cap_hand.forget_parts(|p| p.life.is_dead());
            }
        }
        for p in &gone_parts {
            let h = hash_strs(&[&p.tenant.name, &p.model.name, &p.scope.scheme, &p.adapter]);
            self.parts.remove(h, Arc::as_ptr(p));
            p.model
                .parts()
                .retain(|q| !std::ptr::eq(q.as_ptr(), Arc::as_ptr(p)));
            p.scope.parts.fetch_sub(1, Ordering::Relaxed);
        }
        // The quota hands know partitions too (weakly between enforcements): forget the
        // reclaimed ones now, so an idle tenant's hand keeps neither their allocations (a weak
        // reference keeps one) nor positions that moved.
        let mut tenants: Vec<&Arc<TenantRec>> = gone_parts.iter().map(|p| &p.tenant).collect();
        tenants.sort_unstable_by_key(|t| Arc::as_ptr(t));
        tenants.dedup_by_key(|t| Arc::as_ptr(t));
        for t in tenants {
            if let Some(hand) = t.quota_hand.get() {
                hand.lock().forget_parts(|p| p.life.is_dead());
            }
        }
        out.records_reclaimed += gone_parts.len() as u64;
        drop(gone_parts);
        for scope in self.scopes.all() {
            if scope.parts.load(Ordering::Relaxed) == 0 {
                let h = hash_strs(&[&scope.tenant, &scope.model, &scope.scheme]);
                self.scopes.remove(h, Arc::as_ptr(&scope));
                out.records_reclaimed += 1;
            } else {
                out.replica_slots_reclaimed += scope.reclaim_slots() as u64;
            }
        }
        let mut gone_models: Vec<Arc<ModelRec>> = Vec::new();
        self.all_models.lock().retain(|m| {
            let empty =
                |m: &ModelRec| m.parts().is_empty() && m.stats.load(&epoch::pin()).is_empty();
            if !empty(m) || !m.life.try_retire() {
                return true;
            }
            if !empty(m) {
                m.life.revive();
                return true;
            }
            gone_models.push(m.clone());
            false
        });
        for m in &gone_models {
            self.models
                .remove(hash_strs(&[&m.tenant.name, &m.name]), Arc::as_ptr(m));
            m.tenant
                .models
                .lock()
                .retain(|q| !std::ptr::eq(q.as_ptr(), Arc::as_ptr(m)));
            if m.gauge.pairs.fetch_sub(1, Ordering::Relaxed) == 1 {
                self.gauges
                    .remove(hash_strs(&[&m.gauge.model]), Arc::as_ptr(&m.gauge));
                out.records_reclaimed += 1;
            }
        }
        out.records_reclaimed += gone_models.len() as u64;
        for m in &gone_models {
            let t = &m.tenant;
            if t.models.lock().is_empty()
                && self.tenants.remove(hash_strs(&[&t.name]), Arc::as_ptr(t))
            {
                // `tenant_evictions_total` is a counter: it outlives the record (and goes
                // back to the tenant if it returns).
                let n = t.quota_evictions.load(Ordering::Relaxed);
                if n > 0 {
                    self.retired_quota_evictions
                        .lock()
                        .insert(t.name.clone(), n);
                }
                out.records_reclaimed += 1;
            }
        }
    }

    /// Sets `ready` and starts a std thread that runs [`Index::sweep_now`] every sweep interval
    /// (no async runtime). Idempotent.
    pub fn start(self: &Arc<Self>) {
        let mut tk = self.ticker.lock();
        self.ready.store(true, Ordering::SeqCst);
        if tk.is_some() {
            return;
        }
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let weak: Weak<Index> = Arc::downgrade(self);
        let interval = std::time::Duration::from_millis(self.cfg.sweep_interval_ms as u64);
        let stop2 = stop.clone();
        let handle = std::thread::Builder::new()
            .name("inferencecache-sweep".into())
            .spawn(move || {
                loop {
                    {
                        let mut s = stop2.0.lock();
                        if !*s {
                            stop2.1.wait_for(&mut s, interval);
                        }
                        if *s {
                            return;
                        }
                    }
                    match weak.upgrade() {
                        Some(ix) => {
                            ix.sweep_now();
                        }
                        None => return,
                    }
                }
            })
            .expect("spawn sweep thread");
        *tk = Some(Ticker { stop, handle });
    }

    /// Marks the index ready without a sweep thread (the caller drives [`Index::sweep_now`]).
    pub fn start_without_ticker(&self) {
        self.ready.store(true, Ordering::SeqCst);
    }

    /// Clears `ready` and stops the sweep thread (if any).
    pub fn stop(&self) {
        self.ready.store(false, Ordering::SeqCst);
        let t = self.ticker.lock().take();
        if let Some(t) = t {
            *t.stop.0.lock() = true;
            t.stop.1.notify_all();
            if t.handle.thread().id() != std::thread::current().id() {
                let _ = t.handle.join();
            }
        }
    }

    /// Whether `start` ran and `stop` did not since.
    pub fn ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use crate::clock::ManualClock;
    use crate::config::{DefaultResolvers, IndexConfig};
    use crate::index::Index;
    use crate::index::records::{Partition, TenantRec};
    use crate::index::testing::{NOW, all_cleared, index_at_now, single};
    use crate::types::*;
    use crossbeam_epoch as epoch;
    use std::sync::{Arc, Weak};

    /// Tenant churn (issue 42): 2,000 tenants of one 2-block chain each, ingested by a producer
    /// thread that then stays alive and quiet (a connection after a churn wave), expire. The
    /// sweep reclaims their records and frees them, partitions with their key tables, although
    /// the producer's thread rebuilt the directories (whose old tables listed the records) and
    /// never pins again; the engine's gauge goes to 0.
    #[test]
    fn expired_tenants_are_freed_by_the_sweep() {
        let clock = Arc::new(ManualClock::new(NOW));
        let ix = Arc::new(Index::new(
            IndexConfig {
                global_ttl_ms: 1_000,
                ..Default::default()
            },
            Arc::new(DefaultResolvers),
            clock.clone(),
        ));
        let (ingested, quiet) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
        let producer = {
            let (ix, ingested) = (ix.clone(), ingested.0);
            let quiet = quiet.1;
            std::thread::spawn(move || {
                let counts = [16i32; 2];
                for k in 0..2_000u64 {
                    let keys = [(2 * k).to_be_bytes(), (2 * k + 1).to_be_bytes()];
                    ix.ingest(CacheStateUpdate {
                        replica_id: "r0",
                        model_id: "m",
                        tenant_id: &format!("churn-{k:06}"),
                        hash_scheme: "s",
                        timestamp_us: NOW,
                        adapter_id: "",
                        stats: None,
                        prefixes: std::iter::once(PrefixRef::<[u8; 8]> {
                            prefix_hash: b"",
                            token_count: 0,
                            block_hashes: &keys,
                            block_token_counts: &counts,
                            tier: 0,
                            adapter_id: "",
                        }),
                    });
                }
                ingested.send(()).expect("the test waits");
                // Alive and quiet until the test ends: its epoch bag stays as it is.
                let _ = quiet.recv();
            })
        };
        ingested.1.recv().expect("the producer ingested");
        let parts: Vec<Weak<Partition>> = ix.parts.all().iter().map(Arc::downgrade).collect();
        let tenants: Vec<Weak<TenantRec>> = ix.tenants.all().iter().map(Arc::downgrade).collect();
        assert_eq!((parts.len(), tenants.len()), (2_000, 2_000));
        assert!(ix.memory_bytes() > 2_000 * 1_024);
        clock.advance_ms(2_000);
        let out = ix.sweep_now();
        assert_eq!(out.entries_removed, 4_000);
        assert_eq!(ix.storage_entries(), 0);
        assert_eq!(ix.memory_bytes(), 0);
        let alive = || {
            (
                parts.iter().filter(|w| w.strong_count() > 0).count(),
                tenants.iter().filter(|w| w.strong_count() > 0).count(),
            )
        };
        // Later sweeps (the server's ticker) free what a pin of another test held back at the
        // first one; bounded in time, not in attempts, for a loaded machine.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while alive() != (0, 0) && std::time::Instant::now() < deadline {
            ix.sweep_now();
            std::thread::yield_now();
        }
        assert_eq!(alive(), (0, 0), "(partitions, tenants) alive after expiry");
        drop(quiet.0);
        producer.join().expect("the producer ends");
    }

    /// Rolling restarts forever (issue 28): 64 pods of one scope, each renamed after holding
    /// one entry, 20,000 names over time. Once a renamed pod's entry and stats are gone and
    /// the sweep reclaimed its slot, its id leaves the interner (at the first intern or sweep
    /// after the epoch): the interner holds about the live fleet, not every name ever seen.
    #[test]
    fn renamed_pods_leave_the_interner() {
        let ix = index_at_now();
        let pod = |k: usize| format!("rolling-pod-{k:06}");
        let ingest = |name: &str, key: u64| {
            ix.ingest(CacheStateUpdate {
                replica_id: name,
                model_id: "m",
                tenant_id: "t",
                hash_scheme: "s",
                timestamp_us: NOW,
                adapter_id: "",
                stats: Some(ReplicaStatsInput::default()),
                prefixes: std::iter::once(PrefixRef::<&[u8]> {
                    prefix_hash: &key.to_be_bytes(),
                    token_count: 16,
                    block_hashes: &[],
                    block_token_counts: &[],
                    tier: 0,
                    adapter_id: "",
                }),
            });
        };
        let mut most = 0;
        for k in 0..20_000usize {
            ingest(&pod(k), k as u64);
            if k >= 64 {
                // The pod renamed away: its entry and stats go (ALL_CLEARED).
                all_cleared(&ix, &pod(k - 64));
            }
            if k % 1_000 == 999 {
                ix.sweep_now();
                // Freed names wait for the epoch: other tests' threads pinned meanwhile delay
                // it, so flush until the count settles before sampling (bounded in time, not
                // in attempts: on a loaded machine a test pinned next to this one holds the
                // epoch back for as long as it runs).
                let live = || crate::replica_id::interned_with_prefix("rolling-pod-");
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
                while live() > 64 + 1_000 + 128 && std::time::Instant::now() < deadline {
                    epoch::pin().flush();
                    // Released slots are emptied by the next intern or sweep.
                    ix.sweep_now();
                    std::thread::yield_now();
                }
                most = most.max(live());
            }
        }
        assert_eq!(ix.storage_entries(), 64);
        assert!(
            most <= 64 + 1_000 + 128,
            "the interner holds about the live fleet: {most} ids (20,000 seen)"
        );
        drop(ix);
        // Bounded in time, as above: a test pinned next to this one (the engine's property
        // tests pin for seconds) holds the epoch back, and the names with it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while crate::replica_id::interned_with_prefix("rolling-pod-") != 0
            && std::time::Instant::now() < deadline
        {
            epoch::pin().flush();
            std::thread::yield_now();
        }
        assert_eq!(
            crate::replica_id::interned_with_prefix("rolling-pod-"),
            0,
            "nothing is left once the index is gone"
        );
    }

    /// A reclaimed slot lets go of its id at the first sweep after the epoch, not when a new
    /// id takes the slot: a pod that went away leaves the interner though no other pod ever
    /// comes.
    #[test]
    fn a_reclaimed_slot_frees_its_id_without_a_successor() {
        let ix = index_at_now();
        // A second pod keeps the scope (and its slot array) alive throughout.
        single(&ix, "lone-pod-stays", &[7; 8]);
        single(&ix, "lone-pod-leaves", &[7; 8]);
        all_cleared(&ix, "lone-pod-leaves");
        ix.sweep_now();
        let left = || crate::replica_id::interned_with_prefix("lone-pod-leaves");
        // Bounded in time: other tests' pinned threads may hold the epoch back meanwhile.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while left() > 0 && std::time::Instant::now() < deadline {
            epoch::pin().flush();
            ix.sweep_now();
            std::thread::yield_now();
        }
        assert_eq!(
            left(),
            0,
            "the reclaimed slot's id is freed after the epoch"
        );
        assert_eq!(
            crate::replica_id::interned_with_prefix("lone-pod-stays"),
            1,
            "the pod still holding an entry keeps its id"
        );
        assert_eq!(ix.storage_entries(), 1);
    }
}
