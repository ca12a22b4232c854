//! Ingest (K1–K16, S1–S4): one `CacheStateUpdate` upserted chain by chain under the partitions'
//! writers, its stats stored, then the ingesting tenant's quota (V5) and the global cap (V2).
//!
//! Each chain is one write of the partition's run store (`raw/run_store.rs`: one writer lock
//! per chain, its stretches matched against the runs they name), which calls back per entry
//! it adds (the change events, N1, in chain order). Derived counters (keys, entries, serving
//! counts) are not touched per block: their deltas collect in a [`Pending`] per (partition,
//! replica) run and are applied once, after the entries are published (C3).

use super::eviction::{PartPtr, RecentEntry};
use super::records::{ModelRec, Partition, StatsRecord};
use super::{Index, STATS_RECORD_BYTES};
use crate::ReplicaId;
use crate::clock::us_to_ms;
use crate::directory::same_str;
use crate::raw::holder::{digest, tier_code};
use crate::raw::run_store::{Keys, Writing};
use crate::sink::{ChangeEvent, ChangeKind, ChangeSink};
use crate::sync::Ordering;
use crate::types::*;
use crossbeam_epoch::{self as epoch, Guard};

/// What a chain write writes with: the partition, the replica's state, and what its change
/// events name.
pub(super) struct ChainWrite<'a> {
    pub(super) part: &'a Partition,
    pub(super) writing: Writing,
    pub(super) replica: &'a str,
    pub(super) ts_us: i64,
    pub(super) sink: Option<&'a dyn ChangeSink>,
}

/// Derived counter deltas of an ingest not yet applied (see `Index::flush_pending`).
#[derive(Default)]
pub(super) struct Pending {
    pub(super) keys: i64,
    pub(super) entries: i64,
    /// New entries not yet added to the index-wide entry count. (Removals are subtracted from
    /// it at once, before the unlink: see `Index::remove_holder`.)
    pub(super) added: i64,
    /// The first few new entries with 8-byte keys: `(key, generation)`, for the cap's
    /// recent-entries feed (see `eviction.rs`).
    created: [(u64, u32); RECENT_PER_RUN],
    n_created: usize,
}

impl Pending {
    #[inline]
    fn note_created(&mut self, key: &[u8], generation: u32) {
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
const RECENT_PER_RUN: usize = 4;

/// The new entries an ingest passes to [`Index::enforce_cap`] (a few per run, none allocated):
/// the first `n` items are set.
#[derive(Default)]
struct Created {
    items: [Option<RecentEntry>; RECENT_PER_RUN],
    n: usize,
}

impl Created {
    /// Moves `pend`'s new entries of `(part, rep)` in (as many as fit).
    fn take(&mut self, part: &Partition, rep: u32, pend: &mut Pending) {
        for &(key, generation) in &pend.created[..std::mem::take(&mut pend.n_created)] {
            if self.n < self.items.len() {
                self.items[self.n] = Some(RecentEntry {
                    part: PartPtr::new(part),
                    key,
                    rep,
                    generation,
                });
                self.n += 1;
            }
        }
    }
}

impl Index {
    /// Applies one `CacheStateUpdate` (K14): upserts, stats, then the ingesting tenant's quota
    /// (V5) and the global cap (V2), also for an empty hash_scheme (K4).
    pub fn ingest<'a, H, I>(&self, update: CacheStateUpdate<'a, I>) -> IngestOutcome
    where
        H: AsRef<[u8]> + 'a,
        I: IntoIterator<Item = PrefixRef<'a, H>>,
    {
        let mut out = IngestOutcome::default();
        let mut created = Created::default();
        let mut carry: Option<HeldBackDeltas<'_>> = None;
        let ts_us = self.resolve_now_us(update.timestamp_us);
        let ts_ms = us_to_ms(ts_us);
        let t = update.tenant_id;
        let m = update.model_id;
        let reserved = self.is_reserved(t);
        let sink = self.active_sink(reserved);
        let guard = epoch::pin();
        // The partitions (and their replica slots) this ingest entered (see `dir::Life`), kept
        // entered until its last counter update, after the cap: `created` and the carry name
        // them. (Only an update naming several adapters has more than `cur`.)
        let mut held: Vec<(&Partition, u32)> = Vec::new();
        let mut last: Option<(&Partition, u32)> = None;
        if !update.hash_scheme.is_empty() {
            // Cache of the last partition and replica index (K5: one per ref), with the derived
            // counter deltas not yet applied for it (flushed once per partition change and at the
            // end: counters may lag an in-flight ingest, C3).
            let mut cur: Option<(&Partition, u32)> = None;
            let mut pend = Pending::default();
            let mut digests: Vec<u64> = Vec::new();
            for r in update.prefixes {
                let adapter = if !r.adapter_id.is_empty() {
                    r.adapter_id
                } else {
                    update.adapter_id
                };
                let chain = !r.block_hashes.is_empty() || !r.block_token_counts.is_empty();
                if chain {
                    // K7: malformed chains (length mismatch or an empty block hash) drop whole.
                    if r.block_hashes.len() != r.block_token_counts.len()
                        || r.block_hashes.iter().any(|h| h.as_ref().is_empty())
                    {
                        continue;
                    }
                } else if r.prefix_hash.is_empty() {
                    continue; // K10 / D8
                }
                let (part, rep) = match cur {
                    Some((p, rep)) if same_str(&p.adapter, adapter) => (p, rep),
                    _ => {
                        if let Some((p, rep)) = cur.take() {
                            created.take(p, rep, &mut pend);
                            self.flush_pending(p, rep, &mut pend, &guard);
                            held.push((p, rep));
                        }
                        let p = self.enter_part(t, m, update.hash_scheme, adapter, &guard);
                        let Some(rep) = p.scope.intern(update.replica_id) else {
                            // The scope names as many replicas as a holder can (2^20): a new
                            // id's entries are dropped, nothing stored is touched.
                            p.life.exit();
                            out.refs_dropped += 1;
                            continue;
                        };
                        cur = Some((p, rep));
                        (p, rep)
                    }
                };
                let writing = Writing {
                    rep,
                    tier: tier_code(r.tier),
                    ts_ms,
                };
                let chain_write = ChainWrite {
                    part,
                    writing,
                    replica: update.replica_id,
                    ts_us,
                    sink: sink.as_deref(),
                };
                if chain {
                    // K8: the blocks, each with the chain's running token count.
                    self.write_chain(
                        &chain_write,
                        r.block_hashes,
                        r.block_token_counts,
                        &mut digests,
                        &guard,
                        &mut out,
                        &mut pend,
                    );
                }
                if !chain || !r.prefix_hash.is_empty() {
                    // K9, K10: the co-set or legacy key with the ref's own token count.
                    self.write_chain(
                        &chain_write,
                        std::slice::from_ref(&r.prefix_hash),
                        std::slice::from_ref(&r.token_count),
                        &mut digests,
                        &guard,
                        &mut out,
                        &mut pend,
                    );
                }
            }
            if let Some((p, rep)) = cur {
                created.take(p, rep, &mut pend);
                // The entry count now (the cap reads it). Over the cap, the last run's key and
                // entry deltas wait for the cap, which cancels same-namespace victims against
                // them.
                self.flush_added(p, &mut pend);
                if self.over_cap() {
                    carry = Some(HeldBackDeltas { part: p, rep, pend });
                } else {
                    self.flush_derived(p, rep, &mut pend, &guard);
                }
                last = Some((p, rep));
            }
        }
        if let Some(st) = update.stats {
            let model = self.enter_model(t, m);
            self.store_stats(&model, update.replica_id, &st, ts_ms);
            model.life.exit();
            out.stats_stored = true;
            if let Some(s) = &sink {
                s.publish(&ChangeEvent {
                    kind: ChangeKind::Stats,
                    tenant_id: t,
                    model_id: m,
                    replica_id: update.replica_id,
                    prefix_hash: &[],
                    adapter_id: "",
                    timestamp_us: ts_us,
                });
            }
        }
        // K14 steps 3 and 4 (after the update's own upserts: they are eligible victims), unless
        // another server decides evictions (replicated mode).
        if self.local_eviction() {
            self.enforce_quota(t, ts_us, &mut carry);
            self.enforce_cap(&created.items[..created.n], carry);
        } else if let Some(c) = carry {
            c.apply(self);
        }
        for (p, rep) in held.into_iter().chain(last) {
            p.scope.exit(rep);
            p.life.exit();
        }
        drop(guard);
        if !reserved {
            self.ingest_blocks.fetch_add(out.upserts, Ordering::Relaxed);
        }
        out
    }

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
    fn flush_added(&self, part: &Partition, pend: &mut Pending) {
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

    /// K11 upserts of a chain's blocks (`counts` their own token counts, K8) for one replica,
    /// in one write of the partition's store; `digests` is scratch. Derived counters go to
    /// `pend`; N1 ADDED is published per new entry, in chain order.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_chain<H: AsRef<[u8]>>(
        &self,
        w: &ChainWrite<'_>,
        hashes: &[H],
        counts: &[i32],
        digests: &mut Vec<u64>,
        guard: &Guard,
        out: &mut IngestOutcome,
        pend: &mut Pending,
    ) {
        digests.clear();
        digests.extend(hashes.iter().map(|h| digest(h.as_ref())));
        let any_long = hashes.iter().any(|h| h.as_ref().len() != 8);
        let keys = match Keys::with_bytes(digests, hashes) {
            Some(keys) if any_long => keys,
            _ => Keys::eight(digests),
        };
        let part = w.part;
        let report = part
            .store
            .ingest_with(keys, counts, w.writing, guard, |i, h| {
                pend.note_created(hashes[i].as_ref(), h.generation());
                if let Some(s) = w.sink {
                    s.publish(&ChangeEvent {
                        kind: ChangeKind::Added,
                        tenant_id: &part.tenant.name,
                        model_id: &part.model.name,
                        replica_id: w.replica,
                        prefix_hash: hashes[i].as_ref(),
                        adapter_id: &part.adapter,
                        timestamp_us: w.ts_us,
                    });
                }
            });
        let (added, new_keys) = (report.added as i64, report.new_keys as i64);
        out.upserts += hashes.len().min(counts.len()) as u64;
        out.keys_added += new_keys as u64;
        out.entries_added += added as u64;
        pend.keys += new_keys;
        pend.entries += added;
        pend.added += added;
    }

    fn store_stats(&self, model: &ModelRec, replica: &str, st: &ReplicaStatsInput, ts_ms: i64) {
        self.store_stats_at(model, replica, st, ts_ms, ts_ms);
    }

    /// S2 store of a replica's stats with its liveness and payload clocks (an update sets both
    /// to its timestamp; a checkpoint load restores each); a record already present keeps the
    /// later clocks.
    pub(super) fn store_stats_at(
        &self,
        model: &ModelRec,
        replica: &str,
        st: &ReplicaStatsInput,
        last_seen_ms: i64,
        reported_ms: i64,
    ) {
        let clean = |x: f32| if x.is_finite() { x } else { 0.0 };
        let added = model.stats.update(|v| {
            let mut v2 = v.clone();
            let rec = |replica: ReplicaId, last: i64, rep: i64| StatsRecord {
                replica,
                cache_memory_bytes: st.cache_memory_bytes,
                hit_rate: clean(st.hit_rate),
                pressure: clean(st.pressure),
                t2_hit_tokens: st.t2_hit_tokens,
                t2_query_tokens: st.t2_query_tokens,
                last_seen_ms: last,
                reported_ms: rep,
            };
            match v.binary_search_by(|r| (*r.replica).cmp(replica)) {
                Ok(i) => {
                    let old = &v[i];
                    v2[i] = rec(
                        old.replica.clone(),
                        old.last_seen_ms.max(last_seen_ms),
                        old.reported_ms.max(reported_ms),
                    );
                    (Some(v2), false)
                }
                Err(i) => {
                    v2.insert(
                        i,
                        rec(ReplicaId::intern(replica), last_seen_ms, reported_ms),
                    );
                    (Some(v2), true)
                }
            }
        });
        if added {
            self.stats_bytes
                .fetch_add(STATS_RECORD_BYTES, Ordering::Relaxed);
        }
    }
}
