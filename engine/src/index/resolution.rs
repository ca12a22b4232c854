//! Resolution: the tenant, (tenant, model), scope and partition records a request names, found
//! wait-free through the directories or created under the record lock, and the per-tenant
//! settings a request resolves to (L7's TTL, the request clock).
//!
//! A record is listed before it is linked: once a writer can reach it through a directory, it
//! is already in every list that walks its kind (`enter_part`), so the walks that must see
//! every entry (ALL_CLEARED, PREFIX_EVICTED, the sweep, the cap) never miss one.

use super::Index;
use super::records::{GaugeRec, ModelRec, Partition, ScopeRec, TenantRec, push_child};
use crate::directory::{hash_strs, same_str};
use crate::sync::{AtomicI64, AtomicU64, Mutex, Ordering};
use crossbeam_epoch::{self as epoch, Guard};
use std::sync::Arc;

/// A resolved partition, for the core match API.
#[derive(Clone, Copy)]
pub struct PartitionHandle<'a> {
    pub(super) p: &'a Partition,
}

impl Index {
    pub(super) fn is_reserved(&self, tenant: &str) -> bool {
        self.cfg.reserved_tenants.iter().any(|t| t == tenant)
    }

    pub(super) fn tenant_ref<'g>(&self, t: &str, guard: &'g Guard) -> Option<&'g TenantRec> {
        self.tenants
            .get(hash_strs(&[t]), |r| same_str(&r.name, t), guard)
    }

    pub(super) fn model_ref<'g>(&self, t: &str, m: &str, guard: &'g Guard) -> Option<&'g ModelRec> {
        self.models.get(
            hash_strs(&[t, m]),
            |r| same_str(&r.tenant.name, t) && same_str(&r.name, m),
            guard,
        )
    }

    pub(super) fn model_arc(&self, t: &str, m: &str) -> Option<Arc<ModelRec>> {
        self.models.get_arc(hash_strs(&[t, m]), &|r: &ModelRec| {
            same_str(&r.tenant.name, t) && same_str(&r.name, m)
        })
    }

    pub(super) fn scope_ref<'g>(
        &self,
        t: &str,
        m: &str,
        s: &str,
        guard: &'g Guard,
    ) -> Option<&'g ScopeRec> {
        self.scopes.get(
            hash_strs(&[t, m, s]),
            |r| same_str(&r.tenant, t) && same_str(&r.model, m) && same_str(&r.scheme, s),
            guard,
        )
    }

    pub(super) fn part_ref<'g>(
        &self,
        t: &str,
        m: &str,
        s: &str,
        a: &str,
        guard: &'g Guard,
    ) -> Option<&'g Partition> {
        self.parts
            .get(hash_strs(&[t, m, s, a]), |p| p.is_named(t, m, s, a), guard)
    }

    /// The tenant record, created if needed (record lock held).
    fn ensure_tenant_locked(&self, t: &str) -> Arc<TenantRec> {
        self.tenants
            .get_or_insert(
                hash_strs(&[t]),
                |r| same_str(&r.name, t),
                || {
                    Arc::new(TenantRec {
                        name: t.into(),
                        reserved: self.is_reserved(t),
                        keys: AtomicI64::new(0),
                        models: Mutex::new(Vec::new()),
                        quota_evictions: AtomicU64::new(
                            self.retired_quota_evictions.lock().remove(t).unwrap_or(0),
                        ),
                        quota_hand: super::records::QuotaHand::new(),
                    })
                },
            )
            .0
    }

    /// The (tenant, model) record, created with its tenant and gauge if needed (record lock
    /// held, so the sweep reclaims none of them meanwhile).
    fn ensure_model_locked(&self, t: &str, m: &str) -> Arc<ModelRec> {
        if let Some(r) = self.model_arc(t, m) {
            return r;
        }
        let tenant = self.ensure_tenant_locked(t);
        let gauge = self
            .gauges
            .get_or_insert(
                hash_strs(&[m]),
                |g| &*g.model == m,
                || {
                    Arc::new(GaugeRec {
                        model: m.into(),
                        keys: AtomicI64::new(0),
                        pairs: std::sync::atomic::AtomicUsize::new(0),
                    })
                },
            )
            .0;
        // Absent under the record lock, which every creator holds: this call creates it.
        let rec = Arc::new(ModelRec {
            tenant: tenant.clone(),
            // The gauge's copy: one per model name, whatever the tenants.
            name: gauge.model.clone(),
            keys: AtomicI64::new(0),
            hot: AtomicI64::new(0),
            gauge: gauge.clone(),
            stats: crate::directory::Rcu::empty_with(Vec::new()),
            life: crate::directory::Life::new(),
        });
        // Listed before it is linked: a record reachable through the directory is in every
        // list that walks its kind (see `enter_part`).
        gauge.pairs.fetch_add(1, Ordering::Relaxed);
        push_child(&mut tenant.models.lock(), Arc::downgrade(&rec));
        self.all_models.lock().push(rec.clone());
        let (linked, created) = self.models.get_or_insert(
            hash_strs(&[t, m]),
            |r| same_str(&r.tenant.name, t) && same_str(&r.name, m),
            || rec.clone(),
        );
        debug_assert!(
            created,
            "(tenant, model) pairs are created under the record lock"
        );
        linked
    }

    /// The (tenant, model) record, entered for a stats write (see [`crate::directory::Life`]); the
    /// caller exits it.
    pub(super) fn enter_model(&self, t: &str, m: &str) -> Arc<ModelRec> {
        if let Some(r) = self.model_arc(t, m)
            && r.life.enter()
        {
            return r;
        }
        let _records = self.records.lock();
        let r = self.ensure_model_locked(t, m);
        // Under the record lock a directory record is live: the sweep retires and unlinks
        // under it.
        let entered = r.life.enter();
        debug_assert!(
            entered,
            "records in the directory are live under the record lock"
        );
        r
    }

    /// The partition, created with its records if needed, entered for an ingest (see
    /// [`crate::directory::Life`]); the caller exits it after its last counter update.
    pub(super) fn enter_part<'g>(
        &self,
        t: &str,
        m: &str,
        s: &str,
        a: &str,
        guard: &'g Guard,
    ) -> &'g Partition {
        if let Some(p) = self.part_ref(t, m, s, a, guard)
            && p.life.enter()
        {
            return p;
        }
        let mut records = self.records.lock();
        if let Some(p) = self.part_ref(t, m, s, a, guard) {
            let entered = p.life.enter();
            debug_assert!(
                entered,
                "records in the directory are live under the record lock"
            );
            return p;
        }
        let model = self.ensure_model_locked(t, m);
        let scope = self
            .scopes
            .get_or_insert(
                hash_strs(&[t, m, s]),
                |r| same_str(&r.tenant, t) && same_str(&r.model, m) && same_str(&r.scheme, s),
                // The names are the pair's and the index's (shared, not copied).
                || {
                    Arc::new(ScopeRec::new(
                        model.tenant.name.clone(),
                        model.name.clone(),
                        records.share(s),
                    ))
                },
            )
            .0;
        let p = Arc::new(Partition {
            tenant: model.tenant.clone(),
            model: model.clone(),
            scope: scope.clone(),
            adapter: records.share(a),
            store: crate::raw::run_store::RunStore::with_reaper(
                crate::raw::run_store::StoreOptions::default(),
                self.run_reaper.clone(),
            ),
            lfu: crate::raw::lfu::LfuCells::new(),
            keys: AtomicI64::new(0),
            entries: AtomicI64::new(0),
            life: crate::directory::Life::new(),
        });
        // Listed before it is linked. Once linked, any writer finds it without the record
        // lock and may store entries in it; the walks that must see every such entry go
        // through the lists (ALL_CLEARED and PREFIX_EVICTED through the model's, the sweep
        // and the cap through `all_parts`). Linked first, a probe's cleanup could run between
        // a second writer's ingest and the listing and miss that writer's entry for good.
        scope.parts.fetch_add(1, Ordering::Relaxed);
        push_child(&mut model.parts(), Arc::downgrade(&p));
        {
            let mut all = self.all_parts.lock();
            all.push(p.clone());
            self.all_parts_len.store(all.len(), Ordering::Release);
        }
        let (_, created) = self.parts.get_or_insert(
            hash_strs(&[t, m, s, a]),
            |p| {
                same_str(&p.adapter, a)
                    && same_str(&p.scope.scheme, s)
                    && same_str(&p.model.name, m)
                    && same_str(&p.tenant.name, t)
            },
            || p,
        );
        debug_assert!(created, "partitions are created under the record lock");
        #[cfg(all(test, not(loom)))]
        tests::after_partition_link();
        let p = self
            .part_ref(t, m, s, a, guard)
            .expect("partition just inserted is present");
        p.life.enter();
        p
    }

    /// Resolves a partition for the core match API (wait-free once resolved). A partition
    /// handed out here is entered for good: the handle borrows it for the index's lifetime,
    /// without a guard, so the sweep never reclaims it.
    pub fn partition(
        &self,
        tenant: &str,
        model: &str,
        scheme: &str,
        adapter: &str,
    ) -> Option<PartitionHandle<'_>> {
        let guard = epoch::pin();
        let p = self.part_ref(tenant, model, scheme, adapter, &guard)?;
        if !p.life.enter() {
            return None; // retired: it was empty, and is gone
        }
        let p: *const Partition = p;
        // SAFETY: entered and never exited, so never retired: the directory keeps its `Arc`
        // for as long as the index lives.
        Some(PartitionHandle { p: unsafe { &*p } })
    }

    /// L7: the tenant's TTL in ms.
    pub(super) fn ttl_for(&self, tenant: &str) -> i64 {
        match self.resolvers.ttl_ms(tenant) {
            Some(t) if t > 0 => t,
            _ => self.cfg.global_ttl_ms,
        }
    }

    pub(super) fn resolve_now_us(&self, ts_us: i64) -> i64 {
        if ts_us == 0 {
            self.clock.now_us()
        } else {
            ts_us
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::config::{DefaultResolvers, IndexConfig};
    use crate::index::testing::NOW;
    use crate::types::*;

    std::thread_local! {
        /// What `enter_part` runs on this thread right after it links a new partition.
        static AFTER_PARTITION_LINK: std::cell::RefCell<Option<Box<dyn FnMut()>>> =
            std::cell::RefCell::new(None);
    }

    /// Test hook of `enter_part`: the moment a new partition becomes reachable by other
    /// writers (see `a_partition_is_listed_before_other_writers_can_reach_it`).
    pub(super) fn after_partition_link() {
        AFTER_PARTITION_LINK.with(|hook| {
            if let Some(f) = hook.borrow_mut().as_mut() {
                f();
            }
        });
    }

    /// The partition-creation race behind the reserved entries a concurrent `/probe` left
    /// (issue 28): the creating writer stops right after the new partition becomes reachable
    /// while a second writer finds it, stores its own entry and sends ALL_CLEARED for its
    /// replica. The clear walks the (tenant, model) pair's partition list, so it must find
    /// the partition there: with the partition linked before it was listed, the second
    /// writer's entry survived its own clear (this test failed with 1 entry left).
    #[test]
    fn a_partition_is_listed_before_other_writers_can_reach_it() {
        let ix = Arc::new(Index::new(
            IndexConfig::default(),
            Arc::new(DefaultResolvers),
            Arc::new(ManualClock::new(NOW)),
        ));
        let ingest = |ix: &Index, rep: &str| {
            ix.ingest(CacheStateUpdate {
                replica_id: rep,
                model_id: "m",
                tenant_id: crate::config::PROBE_TENANT,
                hash_scheme: "s",
                timestamp_us: NOW,
                adapter_id: "",
                stats: None,
                prefixes: std::iter::once(PrefixRef::<&[u8]> {
                    prefix_hash: b"probe-key",
                    token_count: 16,
                    block_hashes: &[],
                    block_token_counts: &[],
                    tier: 0,
                    adapter_id: "",
                }),
            })
        };
        let clear = |ix: &Index, rep: &str| {
            ix.apply_event(CacheEventInput {
                event_type: crate::types::event_type::ALL_CLEARED,
                replica_id: rep,
                model_id: "m",
                tenant_id: crate::config::PROBE_TENANT,
                prefix_hash: &[],
                timestamp_us: NOW,
                adapter_id: "",
            })
        };
        let (to_second, second_starts) = std::sync::mpsc::channel::<()>();
        let (to_first, second_done) = std::sync::mpsc::channel::<()>();
        let second = {
            let ix = ix.clone();
            std::thread::spawn(move || {
                second_starts
                    .recv()
                    .expect("the first writer linked the partition");
                ingest(&ix, "b");
                let stored = ix.reserved_storage_entries();
                clear(&ix, "b");
                to_first.send(()).expect("the first writer waits");
                stored
            })
        };
        AFTER_PARTITION_LINK.with(|hook| {
            *hook.borrow_mut() = Some(Box::new(move || {
                to_second.send(()).expect("the second writer waits");
                second_done.recv().expect("the second writer cleared");
            }))
        });
        ingest(&ix, "a");
        AFTER_PARTITION_LINK.with(|hook| hook.borrow_mut().take());
        assert_eq!(
            second.join().expect("second writer"),
            1,
            "the second writer stored its entry in the new partition"
        );
        assert_eq!(
            ix.entry(crate::config::PROBE_TENANT, "m", "s", "", b"probe-key", "b"),
            None,
            "ALL_CLEARED for b removed b's entry"
        );
        assert_eq!(ix.reserved_storage_entries(), 1, "a's entry only");
        clear(&ix, "a");
        assert_eq!(ix.reserved_storage_entries(), 0);
    }
}
