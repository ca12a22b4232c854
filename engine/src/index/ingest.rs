//! Ingest (K1–K16, S1–S4): one `CacheStateUpdate` upserted chain by chain under the shard
//! writers, its stats stored, then the ingesting tenant's quota (V5) and the global cap (V2).
//!
//! Derived counters (keys, entries, serving counts) are not touched per block: their deltas
//! collect in a [`Pending`] per (partition, replica) run and are applied once, after the
//! entries are published (C3). A chain ingest also builds the chain run its blocks share
//! ([`RunPlan`], `raw/runs.rs`), which lookups then step over.

use super::eviction::RecentEntry;
use super::lookahead::Lookahead;
use super::records::{ModelRec, Partition, StatsRecord};
use super::{Index, STATS_RECORD_BYTES};
use crate::ReplicaId;
use crate::clock::us_to_ms;
use crate::directory::same_str;
use crate::raw::node::{Holder, KeyNode, tier_code};
use crate::raw::runs::{ChainRun, MAX_RUN, MIN_RUN};
use crate::raw::table::{KeyTable, Probe, SHARDS};
use crate::raw::writer::ShardWriter;
use crate::sink::{ChangeEvent, ChangeKind, ChangeSink};
use crate::sync::Ordering;
use crate::types::*;
use crossbeam_epoch::{self as epoch, Guard};

struct Ctx<'a> {
    part: &'a Partition,
    sink: Option<&'a dyn ChangeSink>,
}

/// A chain run being built by one chain ingest (see [`Index::plan_run`]).
struct RunPlan {
    run: *const ChainRun,
    /// The node the ingest published naming each offset (0: none).
    nodes: Vec<usize>,
}

impl RunPlan {
    /// The run word for block `j` of the chain, if the run covers it.
    #[inline]
    fn word(&self, j: usize) -> Option<u64> {
        (j < self.nodes.len()).then(|| crate::raw::runs::run_word(self.run, j))
    }

    /// Records what the upsert of block `j` published.
    #[inline]
    fn note(&mut self, j: usize, node: *const KeyNode) {
        if let Some(slot) = self.nodes.get_mut(j) {
            *slot = node as usize;
        }
    }

    /// Writes the stop bits and seals the run, then drops the ingest's reference. Call while
    /// still pinned by the guard the nodes were published under (they may already be replaced;
    /// the guard keeps them readable).
    fn seal(self, part: &Partition, guard: &Guard) {
        let node = |o: usize| -> Option<&KeyNode> {
            // SAFETY: a node this ingest published under `guard`, which is still pinned.
            (self.nodes[o] != 0).then(|| unsafe { &*(self.nodes[o] as *const KeyNode) })
        };
        let published = self.nodes.iter().filter(|&&n| n != 0).count();
        let stop = |o: usize| match (node(o - 1), node(o)) {
            (Some(a), Some(b)) => {
                let (ha, hb) = (a.holders(), b.holders());
                ha.len() != hb.len() || ha.iter().zip(hb.iter()).any(|(x, y)| !x.same_for_lookup(y))
            }
            _ => true,
        };
        // SAFETY: this ingest created the run and has published its last node.
        let freed =
            unsafe { ChainRun::seal(self.run, published, stop, part.table.reaper(), guard) };
        if freed != 0 {
            part.table.add_run_bytes(-(freed as i64));
        }
    }
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

/// The new entries an ingest passes to [`Index::enforce_cap`] (a few per run, none allocated).
#[derive(Default)]
struct Created {
    items: [RecentEntry; RECENT_PER_RUN],
    n: usize,
}

impl Created {
    /// Moves `pend`'s new entries of `(part, rep)` in (as many as fit).
    fn take(&mut self, part: &Partition, rep: u32, pend: &mut Pending) {
        for &(key, generation) in &pend.created[..std::mem::take(&mut pend.n_created)] {
            if self.n < self.items.len() {
                self.items[self.n] = RecentEntry {
                    part: part as *const Partition as usize,
                    key,
                    rep,
                    generation,
                };
                self.n += 1;
            }
        }
    }
}

/// Chains at least this long are ingested grouped by shard (one lock per shard group).
const GROUP_MIN: usize = 8;

/// Holders that fit the stack buffers below without allocating.
const STACK_HOLDERS: usize = 16;

/// Runs `f` on a mutable copy of `hs` (stack buffer when small).
fn with_holders<R>(hs: &[Holder], f: impl FnOnce(&mut [Holder]) -> R) -> R {
    if hs.len() <= STACK_HOLDERS {
        let mut a = [Holder::default(); STACK_HOLDERS];
        a[..hs.len()].copy_from_slice(hs);
        f(&mut a[..hs.len()])
    } else {
        let mut v = hs.to_vec();
        f(&mut v)
    }
}

/// Runs `f` on `hs` with `h` inserted at `pos`.
fn with_holders_inserted<R>(
    hs: &[Holder],
    pos: usize,
    h: Holder,
    f: impl FnOnce(&[Holder]) -> R,
) -> R {
    let n = hs.len() + 1;
    if n <= STACK_HOLDERS {
        let mut a = [Holder::default(); STACK_HOLDERS];
        a[..pos].copy_from_slice(&hs[..pos]);
        a[pos] = h;
        a[pos + 1..n].copy_from_slice(&hs[pos..]);
        f(&a[..n])
    } else {
        let mut v = Vec::with_capacity(n);
        v.extend_from_slice(&hs[..pos]);
        v.push(h);
        v.extend_from_slice(&hs[pos..]);
        f(&v)
    }
}

/// Runs `f` on `hs` without the holder at `pos`.
pub(super) fn with_holders_removed<R>(
    hs: &[Holder],
    pos: usize,
    f: impl FnOnce(&[Holder]) -> R,
) -> R {
    let n = hs.len() - 1;
    if n <= STACK_HOLDERS {
        let mut a = [Holder::default(); STACK_HOLDERS];
        a[..pos].copy_from_slice(&hs[..pos]);
        a[pos..n].copy_from_slice(&hs[pos + 1..]);
        f(&a[..n])
    } else {
        let mut v = hs.to_vec();
        v.remove(pos);
        f(&v)
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
            let mut order: Vec<(u32, i32)> = Vec::new();
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
                let ctx = Ctx {
                    part,
                    sink: sink.as_deref(),
                };
                let tier = tier_code(r.tier);
                let up = |key: &[u8],
                          tokens: i32,
                          run: Option<u64>,
                          pend: &mut Pending,
                          out: &mut IngestOutcome| {
                    self.upsert(
                        &ctx,
                        key,
                        rep,
                        update.replica_id,
                        tokens,
                        ts_ms,
                        ts_us,
                        tier,
                        run,
                        &guard,
                        out,
                        pend,
                    )
                };
                let mut plan = if chain {
                    Self::plan_run(part, r.block_hashes, rep, ts_ms)
                } else {
                    None
                };
                if chain && ctx.sink.is_none() && r.block_hashes.len() >= GROUP_MIN {
                    self.upsert_chain_grouped(
                        part,
                        r.block_hashes,
                        r.block_token_counts,
                        rep,
                        ts_ms,
                        tier,
                        plan.as_mut(),
                        &guard,
                        &mut out,
                        &mut pend,
                        &mut order,
                    );
                } else if chain {
                    let mut sum: i32 = 0;
                    let bh = r.block_hashes;
                    let probe = |j: usize| Probe::new(bh[j].as_ref());
                    let mut ahead = Lookahead::start(&part.table, bh.len(), probe, &guard);
                    for (j, (h, c)) in bh.iter().zip(r.block_token_counts).enumerate() {
                        ahead.step(&part.table, j, bh.len(), probe, &guard);
                        sum = sum.wrapping_add(*c);
                        let run = plan.as_ref().and_then(|pl| pl.word(j));
                        let node = up(h.as_ref(), sum, run, &mut pend, &mut out);
                        if let Some(pl) = plan.as_mut() {
                            pl.note(j, node);
                        }
                    }
                }
                if let Some(pl) = plan {
                    pl.seal(part, &guard);
                }
                if !chain || !r.prefix_hash.is_empty() {
                    up(r.prefix_hash, r.token_count, None, &mut pend, &mut out);
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

    /// Chain upsert without a change sink: blocks are grouped by shard (stable, so a key repeated
    /// in the chain keeps its last value) and each shard's group is applied under one lock
    /// acquisition. Readers may see the chain's entries appear in any order (C3 asks for no
    /// cross-entry snapshot). With a sink, [`Index::ingest`] keeps chain order for N1.
    #[allow(clippy::too_many_arguments)]
    fn upsert_chain_grouped<H: AsRef<[u8]>>(
        &self,
        part: &Partition,
        hashes: &[H],
        counts: &[i32],
        rep: u32,
        ts_ms: i64,
        tier: u8,
        mut plan: Option<&mut RunPlan>,
        guard: &Guard,
        out: &mut IngestOutcome,
        pend: &mut Pending,
        order: &mut Vec<(u32, i32)>,
    ) {
        let n = hashes.len();
        let mut per = [0u32; SHARDS + 1];
        for h in hashes {
            per[KeyTable::shard_of(Probe::new(h.as_ref())) + 1] += 1;
        }
        for s in 0..SHARDS {
            per[s + 1] += per[s];
        }
        order.clear();
        order.resize(n, (0, 0));
        let mut pos = per;
        let mut sum: i32 = 0;
        for (j, (h, c)) in hashes.iter().zip(counts).enumerate() {
            sum = sum.wrapping_add(*c);
            let s = KeyTable::shard_of(Probe::new(h.as_ref()));
            order[pos[s] as usize] = (j as u32, sum);
            pos[s] += 1;
        }
        let probe = |k: usize| Probe::new(hashes[order[k].0 as usize].as_ref());
        let mut ahead = Lookahead::start(&part.table, n, probe, guard);
        for s in 0..SHARDS {
            let (a, b) = (per[s] as usize, per[s + 1] as usize);
            if a == b {
                continue;
            }
            let mut w = part.table.writer(s);
            for (k, &(j, tokens)) in order.iter().enumerate().take(b).skip(a) {
                ahead.step(&part.table, k, n, probe, guard);
                let j = j as usize;
                let p = Probe::new(hashes[j].as_ref());
                let run = plan.as_ref().and_then(|pl| pl.word(j));
                let (_, node) =
                    Self::upsert_locked(&mut w, p, rep, tokens, ts_ms, tier, run, guard, out, pend);
                if let Some(pl) = plan.as_mut() {
                    pl.note(j, node);
                }
            }
        }
    }

    /// The chain run for a chain ingest (see [`crate::raw::runs`]): its leading blocks with 8-byte
    /// keys (at most [`MAX_RUN`]), `None` when fewer than [`MIN_RUN`]. The blocks this ingest
    /// leaves with several holders get run nodes of their usual size, and those it leaves with
    /// only its own entry get 16-byte member nodes, so a lookup steps over both the shared
    /// prefix and the replica's own tail in a few probes instead of one per block.
    fn plan_run<H: AsRef<[u8]>>(
        part: &Partition,
        hashes: &[H],
        rep: u32,
        ts_ms: i64,
    ) -> Option<RunPlan> {
        let n = hashes.len().min(MAX_RUN);
        let b = hashes[..n]
            .iter()
            .take_while(|h| h.as_ref().len() == 8)
            .count();
        if b < MIN_RUN {
            return None;
        }
        let t = &part.table;
        let keys = hashes[..b]
            .iter()
            .map(|h| <[u8; 8]>::try_from(h.as_ref()).unwrap_or_default());
        let run = ChainRun::create(keys, Holder::member_word(rep, ts_ms))?;
        // SAFETY: just created; the plan holds the creator's reference.
        t.add_run_bytes(unsafe { (*run).bytes() } as i64);
        Some(RunPlan {
            run,
            nodes: vec![0; b],
        })
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

    /// K11 upsert of one (key, replica) entry. Derived counters go to `pend`.
    #[allow(clippy::too_many_arguments)]
    fn upsert(
        &self,
        ctx: &Ctx<'_>,
        key: &[u8],
        rep: u32,
        replica: &str,
        tokens: i32,
        ts_ms: i64,
        ts_us: i64,
        tier: u8,
        run: Option<u64>,
        guard: &Guard,
        out: &mut IngestOutcome,
        pend: &mut Pending,
    ) -> *const KeyNode {
        let part = ctx.part;
        let p = Probe::new(key);
        let mut w = part.table.writer(KeyTable::shard_of(p));
        let (new_entry, node) =
            Self::upsert_locked(&mut w, p, rep, tokens, ts_ms, tier, run, guard, out, pend);
        drop(w);
        if new_entry && let Some(s) = ctx.sink {
            s.publish(&ChangeEvent {
                kind: ChangeKind::Added,
                tenant_id: &part.tenant.name,
                model_id: &part.model.name,
                replica_id: replica,
                prefix_hash: key,
                adapter_id: &part.adapter,
                timestamp_us: ts_us,
            });
        }
        node
    }

    /// The K11 upsert under the key's shard writer. Returns whether a new entry was created,
    /// and the node it published naming `run` (null if none: a node of one holder, or nothing
    /// changed).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(super) fn upsert_locked(
        w: &mut ShardWriter<'_>,
        p: Probe<'_>,
        rep: u32,
        tokens: i32,
        ts_ms: i64,
        tier: u8,
        run: Option<u64>,
        guard: &Guard,
        out: &mut IngestOutcome,
        pend: &mut Pending,
    ) -> (bool, *const KeyNode) {
        out.upserts += 1;
        let mut new_entry = false;
        let mut published = std::ptr::null();
        match w.find_p(p, guard) {
            Some((i, node)) => {
                let hs = node.holders();
                let pos = hs.partition_point(|h| h.rep() < rep);
                if pos < hs.len() && hs[pos].rep() == rep {
                    let h2 = hs[pos].refreshed(tokens, tier, ts_ms);
                    if !h2.same_data(&hs[pos]) {
                        with_holders(&hs, |buf| {
                            buf[pos] = h2;
                            let nn = w.replace(i, buf, run, guard);
                            if run.is_some() {
                                published = nn;
                            }
                        });
                    }
                } else {
                    let g = w.next_generation();
                    let h = Holder::new(rep, tier, tokens, ts_ms, g);
                    with_holders_inserted(&hs, pos, h, |buf| {
                        let nn = w.replace(i, buf, run, guard);
                        if run.is_some() {
                            published = nn;
                        }
                    });
                    new_entry = true;
                    pend.note_created(p.key(), g);
                }
            }
            None => {
                let g = w.next_generation();
                let nn = w.insert_p(p, &[Holder::new(rep, tier, tokens, ts_ms, g)], run, guard);
                if run.is_some() {
                    published = nn;
                }
                new_entry = true;
                pend.note_created(p.key(), g);
                out.keys_added += 1;
                pend.keys += 1;
            }
        }
        if new_entry {
            out.entries_added += 1;
            pend.entries += 1;
            pend.added += 1;
        }
        (new_entry, published)
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
