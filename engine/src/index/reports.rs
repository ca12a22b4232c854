//! Reports: the aggregates (G1 CacheState, G2 snapshot, V6 and V7 counts), per-entry and
//! per-replica reads, record counts and the memory accounting with its breakdown. All are
//! read without a lock on the lookup path's structures, so under concurrent writes they are
//! per-entry consistent, not one atomic snapshot (C3).

use super::Index;
use super::eviction::{EvictionReason, evict_slot};
use super::records::{GaugeRec, ModelRec, Partition, ScopeRec, StatsRecord, TenantRec};
use crate::ReplicaId;
use crate::config::Algorithm;
use crate::directory::{DIRECTORY_NODE_BYTES, hash_strs, same_str};
use crate::raw::holder::tier_wire;
use crate::raw::key::key_parts;
use crate::raw::pages::heap_chunk;
use crate::sync::Ordering;
use crate::types::*;
use crossbeam_epoch as epoch;
use std::collections::HashMap;
use std::sync::{Arc, Weak};

/// [`Index::memory_bytes`] by component.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryBreakdown {
    /// The partitions' key-inline slot tables (key tables and root slots).
    pub slot_tables: i64,
    /// Live block runs (their holders, hints, keys, dead and gone bits).
    pub runs: i64,
    /// The partitions' run-id registries.
    pub run_ids: i64,
    /// LFU cells, their stripes and key sums, and the cells' tables.
    pub lfu: i64,
    /// Everything else `memory_bytes` counts: the records (tenants, pairs, scopes, gauges,
    /// partitions with their tables' inline arrays) with their directory nodes, and stats.
    pub other: i64,
}

/// Live records of an index, by kind (see [`Index::record_counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecordCounts {
    /// Tenants.
    pub tenants: usize,
    /// (tenant, model) pairs.
    pub models: usize,
    /// Scopes (tenant, model, hash scheme).
    pub scopes: usize,
    /// Partitions (scope, adapter).
    pub partitions: usize,
    /// Per-model gauges.
    pub gauges: usize,
    /// Replica ids named by the scopes (one per (scope, replica)).
    pub scope_replicas: usize,
}

/// Bytes of an `Arc`'s header (strong and weak counts).
const ARC_HEADER_BYTES: usize = 16;

/// What one record costs besides what it owns outside itself: its allocation (with the `Arc`
/// header, rounded as the allocator does) and its directory node. A partition's record holds
/// the inline parts of its key tables and run registry (each table's root word and writer
/// counts; the registry's 30 chunk pointers), so those are counted here, not in the tables'
/// own figures, which size what they allocate (segments, a split table's directory, chunks).
fn record_bytes<T>() -> i64 {
    (heap_chunk(std::mem::size_of::<T>() + ARC_HEADER_BYTES) + heap_chunk(DIRECTORY_NODE_BYTES))
        as i64
}

impl Index {
    /// G1 CacheState. The reserved tenant reports empty.
    pub fn cache_state(&self, tenant: &str, model: &str) -> CacheState {
        if self.is_reserved(tenant) {
            return CacheState::default();
        }
        let guard = epoch::pin();
        let Some(m) = self.model_ref(tenant, model, &guard) else {
            return CacheState::default();
        };
        CacheState {
            total_prefixes: m.keys.load(Ordering::Relaxed),
            hot_prefixes: m.hot.load(Ordering::Relaxed),
            replicas: m
                .stats
                .load(&guard)
                .iter()
                .map(|s| ReplicaStatsOut {
                    replica_id: Arc::from(s.replica.as_str()),
                    cache_memory_bytes: s.cache_memory_bytes,
                    hit_rate: s.hit_rate,
                    pressure: s.pressure,
                    t2_hit_tokens: s.t2_hit_tokens,
                    t2_query_tokens: s.t2_query_tokens,
                })
                .collect(),
        }
    }

    /// G2 snapshot data: a non-blocking walk (exact when writes quiesce).
    pub fn snapshot(&self) -> SnapshotData {
        struct Row {
            tenant: Arc<str>,
            replica: ReplicaId,
            prefix_count: i64,
            last_event_ms: Option<i64>,
            stats: Option<(StatsRecord, Arc<str>)>,
        }
        let mut rows: HashMap<(Arc<str>, ReplicaId), Row> = HashMap::new();
        let parts: Vec<Arc<Partition>> = self.all_parts.lock().clone();
        let mut guard = epoch::pin();
        for p in parts.iter().filter(|p| !p.tenant.reserved) {
            let reps = p.scope.replicas.load(&guard);
            p.store.for_each_key(&guard, |_, run, _| {
                run.for_each_holder(|_, h| {
                    let Some(rr) = reps.get(h.rep() as usize) else {
                        return;
                    };
                    let row = rows
                        .entry((p.tenant.name.clone(), rr.name.clone()))
                        .or_insert_with(|| Row {
                            tenant: p.tenant.name.clone(),
                            replica: rr.name.clone(),
                            prefix_count: 0,
                            last_event_ms: None,
                            stats: None,
                        });
                    row.prefix_count += 1;
                    row.last_event_ms = Some(
                        row.last_event_ms
                            .map_or(h.last_seen_ms(), |x| x.max(h.last_seen_ms())),
                    );
                });
            });
            guard.repin();
        }
        let models: Vec<Arc<ModelRec>> = self.all_models.lock().clone();
        for m in models.iter().filter(|m| !m.tenant.reserved) {
            for st in m.stats.load(&guard).iter() {
                let row = rows
                    .entry((m.tenant.name.clone(), st.replica.clone()))
                    .or_insert_with(|| Row {
                        tenant: m.tenant.name.clone(),
                        replica: st.replica.clone(),
                        prefix_count: 0,
                        last_event_ms: None,
                        stats: None,
                    });
                let better = match &row.stats {
                    None => true,
                    Some((cur, cur_model)) => {
                        st.last_seen_ms > cur.last_seen_ms
                            || (st.last_seen_ms == cur.last_seen_ms && *m.name < **cur_model)
                    }
                };
                if better {
                    row.stats = Some((st.clone(), m.name.clone()));
                }
            }
        }
        drop(guard);
        let mut replicas: Vec<SnapshotReplicaRow> = rows
            .into_values()
            .map(|r| {
                let (s, reported) = match &r.stats {
                    Some((s, _)) => (Some(s), true),
                    None => (None, false),
                };
                SnapshotReplicaRow {
                    tenant_id: r.tenant,
                    replica_id: Arc::from(r.replica.as_str()),
                    stats_reported: reported,
                    cache_memory_bytes: s.map_or(0, |s| s.cache_memory_bytes),
                    hit_rate: s.map_or(0.0, |s| s.hit_rate),
                    pressure: s.map_or(0.0, |s| s.pressure),
                    t2_hit_tokens: s.map_or(0, |s| s.t2_hit_tokens),
                    t2_query_tokens: s.map_or(0, |s| s.t2_query_tokens),
                    last_update_us: s.map_or(0, |s| s.last_seen_ms * 1000),
                    prefix_count: r.prefix_count,
                    last_event_at_us: r.last_event_ms.map_or(0, |x| x * 1000),
                }
            })
            .collect();
        replicas.sort_by(|a, b| {
            a.tenant_id
                .cmp(&b.tenant_id)
                .then_with(|| a.replica_id.cmp(&b.replica_id))
        });
        // Tenant rows: tenants with keys or stats.
        let mut tenants: Vec<SnapshotTenantRow> = Vec::new();
        let mut total = 0i64;
        let mut hot_total = 0i64;
        let mut all_tenants = self.tenants.all();
        all_tenants.sort_by(|a, b| a.name.cmp(&b.name));
        for t in all_tenants.iter().filter(|t| !t.reserved) {
            let keys = t.keys.load(Ordering::Relaxed);
            let tmodels: Vec<Arc<ModelRec>> =
                t.models.lock().iter().filter_map(Weak::upgrade).collect();
            let hot: i64 = tmodels.iter().map(|m| m.hot.load(Ordering::Relaxed)).sum();
            let (mut sum, mut cnt) = (0f64, 0usize);
            for r in replicas
                .iter()
                .filter(|r| r.tenant_id == t.name && r.stats_reported)
            {
                sum += r.hit_rate as f64;
                cnt += 1;
            }
            let has_stats = replicas
                .iter()
                .any(|r| r.tenant_id == t.name && r.stats_reported);
            if keys <= 0 && !has_stats {
                continue;
            }
            total += keys;
            hot_total += hot;
            tenants.push(SnapshotTenantRow {
                tenant_id: t.name.clone(),
                index_entries: keys,
                hit_rate: if cnt > 0 { sum / cnt as f64 } else { 0.0 },
                hit_rate_reported: cnt > 0,
                memory_used: 0,
            });
        }
        SnapshotData {
            replicas,
            tenants,
            total_prefixes: total,
            hot_prefixes: hot_total,
        }
    }

    /// V7 gauge: distinct non-reserved keys per model, sorted: every model with a live
    /// (tenant, model) record (a gauge is reclaimed with the last pair counting into it).
    pub fn entry_counts_by_model(&self) -> Vec<(Arc<str>, i64)> {
        let mut v: Vec<(Arc<str>, i64)> = self
            .gauges
            .all()
            .iter()
            .map(|g| (g.model.clone(), g.keys.load(Ordering::Relaxed)))
            .collect();
        // Unstable: a stable sort takes scratch as large as the list (one gauge a held model).
        v.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
        v
    }

    /// Whether `model` has a per-model gauge (V7), i.e. appears in
    /// [`Index::entry_counts_by_model`]: wait-free, allocation-free (the server's metrics admit
    /// a model's series only for models the index holds).
    pub fn holds_model(&self, model: &str) -> bool {
        let guard = epoch::pin();
        self.gauges
            .get(hash_strs(&[model]), |g| &*g.model == model, &guard)
            .is_some()
    }

    /// Non-reserved storage entries (`index_storage_entries`).
    pub fn storage_entries(&self) -> i64 {
        self.storage_entries.load(Ordering::Relaxed)
    }

    /// Reserved storage entries.
    pub fn reserved_storage_entries(&self) -> i64 {
        self.reserved_entries.load(Ordering::Relaxed)
    }

    /// Distinct keys in the whole index, reserved included.
    pub fn total_keys(&self) -> i64 {
        self.total_keys.load(Ordering::Relaxed)
    }

    /// `ingest_blocks_total` (non-reserved upserts).
    pub fn ingest_blocks_total(&self) -> u64 {
        self.ingest_blocks.load(Ordering::Relaxed)
    }

    /// `index_evictions_total{algorithm, reason}`.
    pub fn evictions(&self, algorithm: Algorithm, reason: EvictionReason) -> u64 {
        self.evictions[evict_slot(algorithm, reason)].load(Ordering::Relaxed)
    }

    /// `tenant_evictions_total{tenant_id, reason="over_entries"}`: keys removed by each tenant's
    /// quota (V5), for every tenant with at least one removal, sorted by tenant.
    pub fn tenant_evictions(&self) -> Vec<(Arc<str>, u64)> {
        let _records = self.records.lock();
        let mut v: Vec<(Arc<str>, u64)> = self
            .tenants
            .all()
            .iter()
            .filter_map(|t| {
                let n = t.quota_evictions.load(Ordering::Relaxed);
                (n > 0).then(|| (t.name.clone(), n))
            })
            .collect();
        v.extend(
            self.retired_quota_evictions
                .lock()
                .iter()
                .map(|(t, &n)| (t.clone(), n)),
        );
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Approximate bytes held by the index structures (tables, nodes, cells, records, stats):
    /// every partition's key tables, runs and LFU cells, and every record (tenant, (tenant,
    /// model) pair, scope, gauge, partition) with its directory node. An identity whose
    /// entries all expired counts nothing once the sweep reclaimed its records.
    pub fn memory_bytes(&self) -> i64 {
        let records = self.tenants.len() as i64 * record_bytes::<TenantRec>()
            + self.models.len() as i64 * record_bytes::<ModelRec>()
            + self.scopes.len() as i64 * record_bytes::<ScopeRec>()
            + self.gauges.len() as i64 * record_bytes::<GaugeRec>();
        let parts = self.all_parts.lock();
        let guard = epoch::pin();
        let t: i64 = parts
            .iter()
            .map(|p| {
                p.store.memory_bytes(&guard) as i64 + p.lfu.bytes() + record_bytes::<Partition>()
            })
            .sum();
        t + records + self.stats_bytes.load(Ordering::Relaxed)
    }

    /// [`Index::memory_bytes`] by component (see [`MemoryBreakdown`]).
    pub fn memory_breakdown(&self) -> MemoryBreakdown {
        let parts: Vec<Arc<Partition>> = self.all_parts.lock().clone();
        let mut out = MemoryBreakdown::default();
        let guard = epoch::pin();
        for p in parts.iter() {
            let (slots, runs, ids) = p.store.memory_parts(&guard);
            out.slot_tables += slots as i64;
            out.runs += runs as i64;
            out.run_ids += ids as i64;
            out.lfu += p.lfu.bytes();
        }
        out.other = self.memory_bytes() - out.slot_tables - out.runs - out.run_ids - out.lfu;
        out
    }

    /// Test/debug: one storage entry.
    pub fn entry(
        &self,
        tenant: &str,
        model: &str,
        scheme: &str,
        adapter: &str,
        key: &[u8],
        replica: &str,
    ) -> Option<EntryView> {
        let guard = epoch::pin();
        let p = self.part_ref(tenant, model, scheme, adapter, &guard)?;
        let (digest, long) = key_parts(key);
        let holders = p.store.holders_keyed(digest, long, &guard)?;
        let reps = p.scope.replicas.load(&guard);
        let h = *holders.iter().find(|h| {
            reps.get(h.rep() as usize)
                .is_some_and(|r| same_str(&r.name, replica))
        })?;
        Some(EntryView {
            token_count: h.tokens(),
            last_seen_us: h.last_seen_ms() * 1000,
            tier: tier_wire(h.tier()),
            access_count: p
                .lfu
                .cell(digest, h.rep(), h.generation(), &guard)
                .map_or(0, |c| c.count() as u32),
        })
    }

    /// Test/debug: holders of a key, sorted.
    pub fn holders(
        &self,
        tenant: &str,
        model: &str,
        scheme: &str,
        adapter: &str,
        key: &[u8],
    ) -> Vec<Arc<str>> {
        let guard = epoch::pin();
        let Some(p) = self.part_ref(tenant, model, scheme, adapter, &guard) else {
            return Vec::new();
        };
        let (digest, long) = key_parts(key);
        let Some(holders) = p.store.holders_keyed(digest, long, &guard) else {
            return Vec::new();
        };
        let reps = p.scope.replicas.load(&guard);
        let mut v: Vec<Arc<str>> = holders
            .iter()
            .filter_map(|h| {
                reps.get(h.rep() as usize)
                    .map(|r| Arc::from(r.name.as_str()))
            })
            .collect();
        v.sort();
        v
    }

    /// Test/debug: serving count `serving[scope][replica]` (K16).
    pub fn serving_count(&self, tenant: &str, model: &str, scheme: &str, replica: &str) -> i64 {
        let guard = epoch::pin();
        let Some(s) = self.scope_ref(tenant, model, scheme, &guard) else {
            return 0;
        };
        s.serving_of(replica, &guard)
    }

    /// Test/debug: stats clocks `(last_seen_us, stats_reported_us)` of a record.
    pub fn stats_clocks(&self, tenant: &str, model: &str, replica: &str) -> Option<(i64, i64)> {
        let guard = epoch::pin();
        let m = self.model_ref(tenant, model, &guard)?;
        m.stats_of(replica, &guard)
            .map(|s| (s.last_seen_ms * 1000, s.reported_ms * 1000))
    }

    /// Live records by kind (tests and diagnostics; takes the record lock and walks the scopes).
    pub fn record_counts(&self) -> RecordCounts {
        let _records = self.records.lock();
        RecordCounts {
            tenants: self.tenants.len(),
            models: self.models.len(),
            scopes: self.scopes.len(),
            partitions: self.parts.len(),
            gauges: self.gauges.len(),
            scope_replicas: self.scopes.all().iter().map(|s| s.named()).sum(),
        }
    }
}
