//! Ingest (K1–K16, S1–S4): one `CacheStateUpdate` upserted chain by chain under the partitions'
//! writers, its stats stored, then the ingesting tenant's quota (V5) and the global cap (V2).
//!
//! Each chain is one write of the partition's run store (`raw/run_store/`: one writer lock
//! per chain, its stretches matched against the runs they name), which calls back per entry
//! it adds (the change events, N1, in chain order). Derived counters (keys, entries, serving
//! counts) are not touched per block: their deltas collect in a `Pending` per (partition,
//! replica) run and are applied once, after the entries are published (C3: `counters.rs`).

use super::counters::{HeldBackDeltas, Pending, RECENT_PER_RUN};
use super::eviction::{PartPtr, RecentEntry};
use super::records::{ModelRec, Partition, StatsRecord};
use super::{Index, STATS_RECORD_BYTES};
use crate::ReplicaId;
use crate::clock::us_to_ms;
use crate::directory::same_str;
use crate::raw::holder::tier_code;
use crate::raw::key::{Keys, digest};
use crate::raw::run_store::Writing;
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

/// The new entries an ingest passes to [`Index::enforce_cap`] (a few per run, none allocated):
/// the first `n` items are set.
#[derive(Default)]
struct Created {
    items: [Option<RecentEntry<Partition>>; RECENT_PER_RUN],
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
