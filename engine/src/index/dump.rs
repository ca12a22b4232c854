//! Dumping the index for a checkpoint and loading one back (warm restart).
//!
//! A dump walks each partition's key table in [`DumpPartition::SHARDS`] slices of slot
//! positions without a lock, like the G2 snapshot: each entry it reports is one published
//! holder (per-entry consistent, C3), but entries written during the walk may or may not be
//! included, and an entry moved by a concurrent write may be reported twice (a load applies
//! both; the later one wins) or missed (a miss, never a false entry). That cut is enough for
//! soft state: the index is a hint, and anything written after the cut is reported again by its
//! producer or expires by TTL.
//!
//! Entries are reported run by run: a slice reports the stretches of live offsets whose first
//! key it holds, each holder's entries in offset order. So a replica's entries come in the
//! order its chains had, and a load writes consecutive entries of one tier and `last_seen` as
//! one chain (its blocks' counts the differences of their token counts, which K8's sums give
//! back exactly): the loaded runs share stretches as the dumped ones did, instead of one run per
//! entry.
//!
//! A load writes entries with their own `last_seen`, tier and token counts, then restores
//! their LFU counts into fresh cells and applies the derived counters once per (partition,
//! replica) batch, so a loaded index answers lookups, aggregates and evictions exactly as the
//! dumped one did. Entries already past their tenant's TTL are skipped, and so is anything
//! beyond the global cap (`max_entries`); reserved tenants are never dumped or loaded. Loading
//! never publishes change notifications and does not count as ingest.

use super::Index;
use super::counters::Pending;
use super::ingest::ChainWrite;
use super::records::Partition;
use crate::ReplicaId;
use crate::clock::us_to_ms;
use crate::raw::holder::{clamp_ts, tier_code, tier_wire};
use crate::raw::key::{KeyBytes, key_parts};
use crate::raw::run_store::Writing;
use crate::sync::Ordering;
use crate::types::{IngestOutcome, ReplicaStatsInput};
use crossbeam_epoch as epoch;
use std::sync::Arc;

/// Slices of a partition's dump.
const SHARDS: usize = 16;

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
        &self.part.scope.scheme
    }

    /// Adapter.
    pub fn adapter(&self) -> &str {
        &self.part.adapter
    }

    /// Number of slices ([`DumpPartition::for_each_entry`] takes `0..SHARDS`).
    pub const SHARDS: usize = SHARDS;

    /// Calls `f(key, slot, replica, entry)` for every entry of slice `shard` (lock-free; see
    /// the module docs for the cut it takes and the order). `slot` is the replica's small
    /// dense number in this partition's scope (stable for the walk), so callers can group by
    /// it without hashing names. Slices out of range report nothing.
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
        let len = part.store.scan_len(&guard);
        let from = shard * len / SHARDS;
        let count = (shard + 1) * len / SHARDS - from;
        let mut reps = part.scope.replicas.load(&guard);
        part.store.scan(from, count, &guard, |_, run, o| {
            // A stretch is reported from its first live offset.
            if o > 0 && !run.is_dead(o - 1) {
                return;
            }
            let end = run.live_end(o);
            run.for_each_holder(|_, h| {
                if reps.get(h.rep() as usize).is_none() {
                    // A replica interned after the list was loaded: its entry was written
                    // after the intern, so a fresh load names it.
                    reps = part.scope.replicas.load(&guard);
                }
                let Some(replica) = reps.get(h.rep() as usize) else {
                    return;
                };
                for at in o..end {
                    let key = KeyBytes::new(run.key(at), run.long_key(at));
                    let lfu_count = part
                        .lfu
                        .cell(run.key(at), h.rep(), h.generation(), &guard)
                        .map_or(0, |c| c.count());
                    f(
                        key.as_ref(),
                        h.rep(),
                        replica.name.clone(),
                        DumpedEntry {
                            tokens: run.tokens_at(&h, at),
                            tier: tier_wire(h.tier()),
                            last_seen_ms: h.last_seen_ms(),
                            lfu_count,
                        },
                    );
                }
            });
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

    /// A checkpoint's size hint for slice `shard` of `target`: accepted and ignored (a
    /// partition's tables grow as the load writes).
    pub fn reserve_shard(&self, _target: &LoadTarget<'_>, _shard: usize, _keys: usize) {}

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
        // The entries to write, in the order they came.
        let mut kept: Vec<&LoadEntry<'_>> = Vec::with_capacity(entries.len());
        // New entries this load will write, for the cap.
        let mut fresh = 0i64;
        for e in entries {
            if e.key.is_empty() {
                out.dropped += 1;
                continue;
            }
            if ttl > 0 && now_ms - e.last_seen_ms >= ttl {
                out.expired += 1;
                continue;
            }
            let (digest, long) = key_parts(e.key);
            let present = part.store.entry(digest, long, rep, &guard).is_some();
            if cap > 0 && !present && self.storage_entries.load(Ordering::Relaxed) + fresh >= cap {
                out.dropped += 1;
                continue;
            }
            fresh += i64::from(!present);
            out.loaded += 1;
            kept.push(e);
        }
        let (mut keys, mut counts, mut digests) = (Vec::new(), Vec::new(), Vec::new());
        // One chain per stretch of entries with one tier and `last_seen`, each block's count
        // the difference of its token count and the one before it.
        for chain in kept.chunk_by(|a, b| a.tier == b.tier && a.last_seen_ms == b.last_seen_ms) {
            let write = ChainWrite {
                part,
                writing: Writing {
                    rep,
                    tier: tier_code(chain[0].tier),
                    ts_ms: clamp_ts(chain[0].last_seen_ms),
                },
                replica,
                ts_us: 0,
                sink: None,
            };
            keys.clear();
            keys.extend(chain.iter().map(|e| e.key));
            counts.clear();
            counts.push(chain[0].tokens);
            counts.extend(
                chain
                    .windows(2)
                    .map(|w| w[1].tokens.wrapping_sub(w[0].tokens)),
            );
            self.write_chain(
                &write,
                &keys,
                &counts,
                &mut digests,
                &guard,
                &mut ingest,
                &mut pend,
            );
            for e in chain.iter().filter(|e| e.lfu_count > 0) {
                let (digest, long) = key_parts(e.key);
                part.store
                    .with_entry_locked(digest, long, rep, &guard, |entry| {
                        if let Some(h) = entry {
                            let cell = part.lfu.cell_or_create(e.key, rep, h.generation(), &guard);
                            let gained = cell.restore(e.lfu_count, thr);
                            if gained != 0 {
                                self.add_key_access(&part.model, cell.ksum(), gained);
                            }
                        }
                    });
            }
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
