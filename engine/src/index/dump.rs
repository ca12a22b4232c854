//! Dumping the index for a checkpoint and loading one back (warm restart).
//!
//! A dump walks partitions shard by shard without a lock, like the G2 snapshot: each entry it
//! reports is one published holder (per-entry consistent, C3), but entries written during the
//! walk may or may not be included, and an entry moved by a concurrent table rebuild may be
//! reported twice (a load applies both; the later one wins) or missed (a miss, never a false
//! entry). That cut is enough for soft state: the index is a hint, and anything written after
//! the cut is reported again by its producer or expires by TTL.
//!
//! A load upserts entries with their own `last_seen`, tier and token counts under the shard
//! writer (one lock acquisition per run of same-shard entries, at most [`SLICE`] entries each),
//! then restores their LFU counts into fresh cells and applies the derived counters once per
//! (partition, replica) batch, so a loaded index answers lookups, aggregates and evictions
//! exactly as the dumped one did. Entries already past their tenant's TTL are skipped, and so
//! is anything beyond the global cap (`max_entries`); reserved tenants are never dumped or
//! loaded. Loading never publishes change notifications and does not count as ingest.

use super::ingest::Pending;
use super::records::Partition;
use super::{Index, SLICE};
use crate::ReplicaId;
use crate::clock::us_to_ms;
use crate::raw::node::{clamp_ts, tier_code, tier_wire};
use crate::raw::table::{KeyTable, Probe, SHARDS};
use crate::sync::Ordering;
use crate::types::{IngestOutcome, ReplicaStatsInput};
use crossbeam_epoch as epoch;
use std::sync::Arc;

/// One partition of a dump.
pub struct DumpPartition {
    part: Arc<Partition>,
}

/// One dumped entry: a (key, replica) holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DumpedEntry {
    /// Tokens covered by the key (K11).
    pub tokens: i32,
    /// Wire tier value.
    pub tier: i32,
    /// Last refresh (ms since the epoch).
    pub last_seen_ms: i64,
    /// LFU access count (0 if never credited).
    pub lfu_count: u64,
}

/// One replica's stats record of a (tenant, model).
#[derive(Debug, Clone)]
pub struct DumpedStats {
    /// Tenant.
    pub tenant: Arc<str>,
    /// Model.
    pub model: Arc<str>,
    /// Replica.
    pub replica: ReplicaId,
    /// The stats values.
    pub stats: ReplicaStatsInput,
    /// Liveness clock (ms).
    pub last_seen_ms: i64,
    /// Payload freshness clock (ms).
    pub reported_ms: i64,
}

impl DumpPartition {
    /// Tenant.
    pub fn tenant(&self) -> &str {
        &self.part.tenant.name
    }

    /// Model.
    pub fn model(&self) -> &str {
        &self.part.model.name
    }

    /// Hash scheme.
    pub fn scheme(&self) -> &str {
        &self.part.scheme
    }

    /// Adapter.
    pub fn adapter(&self) -> &str {
        &self.part.adapter
    }

    /// Number of shards ([`DumpPartition::for_each_entry`] takes `0..SHARDS`).
    pub const SHARDS: usize = SHARDS;

    /// Calls `f(key, slot, replica, entry)` for every entry of shard `shard` (lock-free; see
    /// the module docs for the cut it takes). `slot` is the replica's small dense number in
    /// this partition's scope (stable for the walk), so callers can group by it without
    /// hashing names. Shards out of range report nothing.
    pub fn for_each_entry(
        &self,
        shard: usize,
        mut f: impl FnMut(&[u8], u32, ReplicaId, DumpedEntry),
    ) {
        if shard >= SHARDS {
            return;
        }
        let guard = epoch::pin();
        let part = &*self.part;
        let mut reps = part.scope.replicas.load(&guard);
        part.table.for_each_node_in(shard, &guard, |node| {
            let key = node.key();
            let probe = Probe::new(key);
            for h in node.holders().iter() {
                if reps.get(h.rep() as usize).is_none() {
                    // A replica interned after the list was loaded: its node was published
                    // after the intern, so a fresh load names it.
                    reps = part.scope.replicas.load(&guard);
                }
                let Some(replica) = reps.get(h.rep() as usize) else {
                    continue;
                };
                let lfu_count = part
                    .table
                    .lfu_cell(probe, h.rep(), h.generation(), &guard)
                    .map_or(0, |c| c.count());
                f(
                    key,
                    h.rep(),
                    replica.name.clone(),
                    DumpedEntry {
                        tokens: h.tokens(),
                        tier: tier_wire(h.tier()),
                        last_seen_ms: h.last_seen_ms(),
                        lfu_count,
                    },
                );
            }
        });
    }
}

/// Where [`Index::load_entries`] puts entries: one partition, by name (each load enters it
/// through the record gate as an ingest does, so the sweep never reclaims it mid-load).
pub struct LoadTarget<'a> {
    tenant: &'a str,
    model: &'a str,
    scheme: &'a str,
    adapter: &'a str,
}

/// One entry to load.
#[derive(Debug, Clone, Copy)]
pub struct LoadEntry<'a> {
    /// The key.
    pub key: &'a [u8],
    /// Tokens covered by the key.
    pub tokens: i32,
    /// Wire tier value.
    pub tier: i32,
    /// Last refresh (ms since the epoch).
    pub last_seen_ms: i64,
    /// LFU access count to restore.
    pub lfu_count: u64,
}

/// What a load did with its entries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOutcome {
    /// Entries stored (new or refreshed).
    pub loaded: u64,
    /// Entries skipped: past their TTL.
    pub expired: u64,
    /// Entries skipped: the global cap was reached, the key was empty, or the scope names no
    /// more replicas.
    pub dropped: u64,
}

impl LoadOutcome {
    /// Adds `o`'s counts to this one.
    pub fn add(&mut self, o: &LoadOutcome) {
        self.loaded += o.loaded;
        self.expired += o.expired;
        self.dropped += o.dropped;
    }
}

impl Index {
    /// Every partition of a non-reserved tenant, for a checkpoint.
    pub fn dump_partitions(&self) -> Vec<DumpPartition> {
        self.all_parts
            .lock()
            .iter()
            .filter(|p| !p.tenant.reserved)
            .map(|p| DumpPartition { part: p.clone() })
            .collect()
    }

    /// Every replica stats record of a non-reserved tenant, for a checkpoint.
    pub fn dump_stats(&self) -> Vec<DumpedStats> {
        let models = self.all_models.lock().clone();
        let guard = epoch::pin();
        let mut out = Vec::new();
        for m in models.iter().filter(|m| !m.tenant.reserved) {
            for s in m.stats.load(&guard).iter() {
                out.push(DumpedStats {
                    tenant: m.tenant.name.clone(),
                    model: m.name.clone(),
                    replica: s.replica.clone(),
                    stats: ReplicaStatsInput {
                        cache_memory_bytes: s.cache_memory_bytes,
                        hit_rate: s.hit_rate,
                        pressure: s.pressure,
                        t2_hit_tokens: s.t2_hit_tokens,
                        t2_query_tokens: s.t2_query_tokens,
                    },
                    last_seen_ms: s.last_seen_ms,
                    reported_ms: s.reported_ms,
                });
            }
        }
        out
    }

    /// The partition a load writes to (created by the first load); `None` for a reserved
    /// tenant or an empty hash scheme (K4: such entries are never stored).
    pub fn load_target<'a>(
        &self,
        tenant: &'a str,
        model: &'a str,
        scheme: &'a str,
        adapter: &'a str,
    ) -> Option<LoadTarget<'a>> {
        if self.is_reserved(tenant) || scheme.is_empty() {
            return None;
        }
        Some(LoadTarget {
            tenant,
            model,
            scheme,
            adapter,
        })
    }

    /// Enters `target`'s partition (see [`crate::directory::Life`]); the caller exits it.
    fn enter_target<'g>(&self, target: &LoadTarget<'_>, guard: &'g epoch::Guard) -> &'g Partition {
        self.enter_part(
            target.tenant,
            target.model,
            target.scheme,
            target.adapter,
            guard,
        )
    }

    /// Presizes shard `shard` of `target` for `keys` keys (a checkpoint's size hint, see
    /// `ShardWriter::reserve`). Shards out of range are ignored; the caller bounds `keys`.
    pub fn reserve_shard(&self, target: &LoadTarget<'_>, shard: usize, keys: usize) {
        if shard < SHARDS {
            let guard = epoch::pin();
            let part = self.enter_target(target, &guard);
            part.table.writer(shard).reserve(keys, &guard);
            part.life.exit();
        }
    }

    /// Loads `entries` of `replica` into `target` (see the module docs).
    pub fn load_entries(
        &self,
        target: &LoadTarget<'_>,
        replica: &str,
        entries: &[LoadEntry<'_>],
    ) -> LoadOutcome {
        let mut out = LoadOutcome::default();
        let guard = epoch::pin();
        let part = self.enter_target(target, &guard);
        let Some(rep) = part.scope.intern(replica) else {
            part.life.exit();
            out.dropped = entries.len() as u64;
            return out;
        };
        let now_ms = us_to_ms(self.clock.now_us());
        let ttl = self.ttl_for(&part.tenant.name);
        let cap = self.cfg.max_entries;
        let thr = self.hot_threshold();
        let mut pend = Pending::default();
        let mut ingest = IngestOutcome::default();
        let mut i = 0;
        while i < entries.len() {
            let shard = KeyTable::shard_of(Probe::new(entries[i].key));
            let mut w = part.table.writer(shard);
            let mut in_lock = 0;
            while i < entries.len() && in_lock < SLICE {
                let e = &entries[i];
                let p = Probe::new(e.key);
                if KeyTable::shard_of(p) != shard {
                    break;
                }
                i += 1;
                in_lock += 1;
                if e.key.is_empty() {
                    out.dropped += 1;
                    continue;
                }
                if ttl > 0 && now_ms - e.last_seen_ms >= ttl {
                    out.expired += 1;
                    continue;
                }
                if cap > 0
                    && self.storage_entries.load(Ordering::Relaxed) + pend.added >= cap
                    && w.find_p(p, &guard)
                        .and_then(|(_, n)| n.holder(rep))
                        .is_none()
                {
                    out.dropped += 1;
                    continue;
                }
                let ts = clamp_ts(e.last_seen_ms);
                let tier = tier_code(e.tier);
                Self::upsert_locked(
                    &mut w,
                    p,
                    rep,
                    e.tokens,
                    ts,
                    tier,
                    None,
                    &guard,
                    &mut ingest,
                    &mut pend,
                );
                out.loaded += 1;
                if e.lfu_count > 0
                    && let Some(h) = w.find_p(p, &guard).and_then(|(_, n)| n.holder(rep))
                {
                    let cell = w.lfu_cell_or_create(e.key, rep, h.generation(), &guard);
                    let gained = cell.restore(e.lfu_count, thr);
                    if gained != 0 {
                        self.add_key_access(&part.model, cell.ksum(), gained);
                    }
                }
            }
            drop(w);
        }
        self.flush_pending(part, rep, &mut pend, &guard);
        part.scope.exit(rep);
        part.life.exit();
        out
    }

    /// Loads one replica stats record with its clocks (a checkpoint's; a record already present
    /// keeps the later clocks).
    pub fn load_stats(
        &self,
        tenant: &str,
        model: &str,
        replica: &str,
        stats: &ReplicaStatsInput,
        last_seen_ms: i64,
        reported_ms: i64,
    ) -> bool {
        if self.is_reserved(tenant) {
            return false;
        }
        let ttl = self.ttl_for(tenant);
        let now_ms = us_to_ms(self.clock.now_us());
        if ttl > 0 && now_ms - last_seen_ms >= ttl {
            return false;
        }
        let m = self.enter_model(tenant, model);
        self.store_stats_at(&m, replica, stats, last_seen_ms, reported_ms);
        m.life.exit();
        true
    }
}
