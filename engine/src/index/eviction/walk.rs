//! The approximate path (see the room's docs, steps 1–5): the recent-entries feed, the
//! sampled threshold, the walk that refills the candidate buffer, and the next victim.

use super::super::Index;
use super::super::records::{Partition, TenantRec};
use super::context::{Cx, eff_count};
use super::hand::{Hand, Mode, RANK_MAX, Rank, Victim};
use super::*;
use crate::config::Algorithm;
use crate::raw::block_run::ScanStep;
use crate::raw::key::own_key;
use crate::raw::key::{KeyBytes, key_parts};
use crate::sync::Ordering;
use crossbeam_epoch::{self as epoch};

/// Where one step of the walk over a partition left it.
struct WalkStep {
    /// The partition's position to go on from.
    pos: u64,
    /// Positions passed (the walk's budget counts them).
    visited: usize,
    /// The step reached the partition's end.
    lapped: bool,
    /// The step stopped in front of a young run (`Index::walk_runs`): the refill ends.
    at_young: bool,
}

/// The `visit` callback of a walk: pushes each ranked entry of `key` (in partition `part`) at
/// or below `thr` into `cands`.
fn candidates_at_most<'a>(
    thr: Rank,
    part: usize,
    key: &'a [u8],
    cands: &'a mut Vec<Victim>,
) -> impl FnMut(Rank, u32, u32) + 'a {
    move |rank, rep, generation| {
        if rank <= thr {
            cands.push(Victim {
                rank,
                part,
                key: own_key(key),
                rep,
                generation,
            });
        }
    }
}

impl Index {
    /// LFU feed: the oldest remembered new entry that is still present, still at or below the
    /// threshold (i.e. not credited since) and ranked ahead of the buffer's best candidate is
    /// evicted. New entries are the usual LFU victims (count 0), and once they are rare a walk
    /// has to visit many credited entries to find each one; the ring finds them directly.
    /// Every victim still satisfies the sampled threshold (quality argument unchanged).
    pub(super) fn recent_step(&self, hand: &mut Hand<Partition>, cx: &mut Cx) -> bool {
        let Some(thr) = hand.thr else {
            return false;
        };
        if hand.recent.is_empty() {
            return false; // LRU-only indexes never fill the ring: no pin for them
        }
        let guard = epoch::pin();
        for _ in 0..RECENT_TRIES {
            let Some(e) = hand.recent.front().copied() else {
                return false;
            };
            // SAFETY: the ring only names partitions in `hand.parts` (it is filled after the
            // hand caught up with `all_parts`), and the sweep clears it, under this hand's
            // lock, whenever it drops a reclaimed partition from the hand (`forget_parts`).
            let part = unsafe { e.part.get() };
            let key = e.key.to_be_bytes();
            let rank = part
                .store
                .entry(e.key, None, e.rep, &guard)
                .filter(|h| h.generation() == e.generation)
                .map(|h| {
                    let alg = cx.alg(self, &part.tenant);
                    (eff_count(part, e.key, &h, alg, &guard), h.last_seen_ms())
                });
            let Some(rank) = rank.filter(|r| *r <= thr) else {
                hand.recent.pop_front(); // gone, re-created, or credited since: forget it
                continue;
            };
            if hand.cands.last().is_some_and(|best| best.rank <= rank) {
                return false; // the buffer's best comes first in the ideal order
            }
            hand.recent.pop_front();
            let v = Victim {
                rank,
                part: usize::MAX, // not a position in `hand.parts`; unused by `evict_entry`
                key: own_key(&key),
                rep: e.rep,
                generation: e.generation,
            };
            if self.evict_entry(part, &v, thr, cx, None) {
                hand.budget = hand.budget.saturating_sub(1);
                return true;
            }
        }
        false
    }

    /// Evicts one candidate (refilling the buffer when empty). Returns whether progress was made
    /// (a victim removed, or fresh candidates found).
    pub(super) fn approx_step(
        &self,
        hand: &mut Hand<Partition>,
        cx: &mut Cx,
        tenant: Option<&TenantRec>,
    ) -> bool {
        let Some(v) = hand.cands.pop() else {
            return self.refill(hand, cx);
        };
        let thr = hand.thr.unwrap_or(RANK_MAX);
        // Borrowed, not cloned: the hand keeps its partitions, and a clone would be two locked
        // reference-count updates per victim.
        let part = &hand.parts[v.part];
        let removed = match cx.mode {
            Mode::Cap => self.evict_entry(part, &v, thr, cx, Some(&mut hand.cands)),
            Mode::Quota => self.evict_key(part, v.key.as_bytes(), thr.1, cx.now_us),
        };
        // The next victim's slots are random lines of a table larger than the caches: fetched
        // now, they arrive while the next ingest runs (the cap takes about one victim per
        // ingest at the cap).
        if let Some(next) = hand.cands.last() {
            let (digest, _) = key_parts(next.key.as_bytes());
            hand.parts[next.part]
                .store
                .prefetch_removal(digest, &epoch::pin());
        }
        if removed {
            hand.budget = hand.budget.saturating_sub(1);
            if let Some(t) = tenant {
                t.quota_evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        // A failed re-validation still consumed a candidate: progress.
        true
    }

    /// Refills the candidate buffer: a new estimate when due, then a bounded walk.
    pub(super) fn refill(&self, hand: &mut Hand<Partition>, cx: &mut Cx) -> bool {
        if hand.thr.is_none() || hand.budget == 0 || hand.lapped {
            self.estimate(hand, cx);
            if !hand.cands.is_empty() {
                hand.sort_cands();
                return true;
            }
        }
        if hand.thr.is_none() {
            return false;
        }
        let start = hand.cursor;
        self.walk(hand, cx);
        if hand.cands.is_empty() {
            // Too strict, or stale: re-estimate next time. The first time, the cursor goes
            // back to where this walk began, so the fresh threshold walks the same runs: they
            // lie roughly oldest first (ids are reused in eviction order), and skipped by a
            // stale threshold they would wait a whole lap while younger runs are taken. A
            // fresh threshold that finds nothing there either moves on.
            if !hand.rewalked {
                hand.cursor = start;
            }
            hand.rewalked = !hand.rewalked;
            hand.thr = None;
            return false;
        }
        hand.rewalked = false;
        hand.sort_cands();
        true
    }

    /// Samples the population, sets the threshold and seeds the buffer with the samples at or
    /// below it.
    pub(super) fn estimate(&self, hand: &mut Hand<Partition>, cx: &mut Cx) {
        hand.cands.clear();
        hand.samples.clear();
        hand.cum.clear();
        hand.lapped = false;
        let mut total = 0i64;
        for p in hand.parts.iter() {
            total += cx.weight(p);
            hand.cum.push(total);
        }
        if total <= 0 {
            hand.thr = None;
            return;
        }
        let guard = epoch::pin();
        let mut tries = 0;
        while hand.samples.len() < SAMPLES && tries < SAMPLE_ATTEMPTS {
            tries += 1;
            let r = hand.below(total as u64) as i64;
            let pi = hand.cum.partition_point(|&c| c <= r);
            let slot = hand.next();
            let p = &hand.parts[pi];
            let samples = &mut hand.samples;
            p.store.sample(slot, &guard, |digest, run, o| {
                let key = own_key(KeyBytes::new(digest, run.long_key(o)).as_ref());
                self.visit(cx, p, run, o, &guard, |rank, rep, generation| {
                    samples.push(Victim {
                        rank,
                        part: pi,
                        key: key.clone(),
                        rep,
                        generation,
                    });
                });
            });
        }
        if hand.samples.is_empty() {
            // Too sparse to sample: let the walk take anything.
            hand.thr = Some(RANK_MAX);
            hand.budget = 1;
            return;
        }
        hand.samples.sort_unstable_by_key(|v| v.rank);
        let uniform = hand.samples[0].rank.0 == hand.samples[hand.samples.len() - 1].rank.0;
        let k = match (cx.mode, uniform) {
            (Mode::Quota, _) => THRESHOLD_RANK_QUOTA,
            (Mode::Cap, true) => THRESHOLD_RANK_BY_AGE,
            (Mode::Cap, false) => THRESHOLD_RANK,
        }
        .min(hand.samples.len() - 1);
        let thr = hand.samples[k].rank;
        hand.thr = Some(thr);
        // Estimated population at or below the threshold; re-estimate after half of it.
        let below = (k as i64 + 1) * total / hand.samples.len() as i64;
        hand.budget = (below / 2).max(1) as u64;
        let n = hand.samples.partition_point(|v| v.rank <= thr);
        hand.cands.extend(hand.samples.drain(..n));
    }

    /// Walks the cursor lock-free over the partitions, collecting candidates at or below the
    /// threshold: the cap's LRU partitions by their run registry, the others by their key
    /// table in key order.
    pub(super) fn walk(&self, hand: &mut Hand<Partition>, cx: &mut Cx) {
        let Some(thr) = hand.thr else {
            return;
        };
        if hand.parts.is_empty() {
            return;
        }
        let (mut pi, mut pos) = hand.cursor;
        let mut visited = 0;
        let mut wraps = 0;
        while visited < WALK_BUDGET && hand.cands.len() < CANDIDATES {
            if pi >= hand.parts.len() {
                (pi, pos) = (0, 0);
                hand.lapped = true;
                wraps += 1;
                if wraps > 1 {
                    break; // nothing eligible at all
                }
                continue;
            }
            let p = &hand.parts[pi];
            if !cx.eligible(p) {
                (pi, pos) = (pi + 1, 0);
                visited += 1;
                continue;
            }
            let step = if cx.mode == Mode::Cap && cx.alg(self, &p.tenant) == Algorithm::Lru {
                self.walk_runs(cx, p, (pi, pos), thr, &mut hand.cands)
            } else {
                self.walk_keys(cx, p, (pi, pos), thr, &mut hand.cands)
            };
            visited += step.visited;
            pos = step.pos;
            if step.at_young {
                break;
            }
            if step.lapped {
                pos = 0;
                pi += 1;
            }
        }
        hand.cursor = (pi, pos);
    }

    /// One step of the walk over partition `p`'s run registry from position `at.1` (a run id).
    /// Each registry entry keeps its run's age, a lower bound of its holders' `last_seen`, so
    /// with a threshold count of 0 a run younger than the threshold holds no candidate and is
    /// passed on its entry alone; a higher count admits runs of any age.
    fn walk_runs(
        &self,
        cx: &mut Cx,
        p: &Partition,
        at: (usize, u64),
        thr: Rank,
        cands: &mut Vec<Victim>,
    ) -> WalkStep {
        let guard = epoch::pin();
        let (pi, pos) = (at.0, at.1 as usize);
        let max_age = if thr.0 == 0 { thr.1 } else { i64::MAX };
        // Under LRU a cap victim's run mates carry its holder entry and follow it (module
        // docs, step 4): a run's first live block stands for all of them. Otherwise (quota
        // victims are keys) every live block is a candidate.
        let blocks_per_run = if cx.mode == Mode::Cap && cx.alg(self, &p.tenant) == Algorithm::Lru {
            1
        } else {
            usize::MAX
        };
        let len = p.store.run_scan_len();
        // A position from a key-table walk (the tenant's algorithm changed) may lie past it.
        let pos = pos.min(len);
        let end = (pos + WALK_STEP).min(len);
        let mut at_young = false;
        let stopped = p.store.scan_runs(pos, end, max_age, &guard, |step| {
            let ScanStep::Old(run) = step else {
                // A young run after candidates: the walk stops in front of it. Runs lie
                // roughly oldest first from the cursor on (ids are reused in eviction order),
                // so the first young one is where a threshold gone stale starts to pass runs a
                // fresh one would take; passed, they would wait a lap.
                at_young = !cands.is_empty();
                return !at_young;
            };
            let live = (0..run.len()).filter(|&o| !run.is_dead(o));
            for o in live.take(blocks_per_run) {
                let key = KeyBytes::new(run.key(o), run.long_key(o));
                let sink = candidates_at_most(thr, pi, key.as_ref(), cands);
                self.visit(cx, p, run, o, &guard, sink);
            }
            // A long run's blocks can fill the buffer many times over: the rest of the step
            // waits for the next refill.
            cands.len() < CANDIDATES
        });
        WalkStep {
            pos: stopped as u64,
            visited: (stopped - pos).max(1),
            lapped: stopped >= len,
            at_young,
        }
    }

    /// One step of the walk over partition `p`'s key table from position `at.1` (a
    /// fraction of the table in units of 2^-32: tables are rebuilt at other sizes under the
    /// walk, and a key's home keeps its relative position). Under LFU the victims are the
    /// entries of low counts, new ones among them, which the registry keeps in no useful order
    /// (a new run takes the id its victim freed, just behind the cursor): in key order they
    /// are spread evenly over the lap.
    fn walk_keys(
        &self,
        cx: &mut Cx,
        p: &Partition,
        at: (usize, u64),
        thr: Rank,
        cands: &mut Vec<Victim>,
    ) -> WalkStep {
        const WHOLE: u64 = 1 << 32;
        let guard = epoch::pin();
        let (pi, pos) = at;
        let pos = pos.min(WHOLE);
        let len = p.store.scan_len(&guard);
        let step = ((WALK_STEP as u64) << 32)
            .div_ceil(len.max(1) as u64)
            .min(WHOLE);
        let end = (pos + step).min(WHOLE);
        let first = ((pos as u128 * len as u128) >> 32) as usize;
        let last = ((end as u128 * len as u128) >> 32) as usize;
        p.store.scan(first, last - first, &guard, |digest, run, o| {
            let key = KeyBytes::new(digest, run.long_key(o));
            let sink = candidates_at_most(thr, pi, key.as_ref(), cands);
            self.visit(cx, p, run, o, &guard, sink);
        });
        WalkStep {
            pos: end,
            visited: (last - first).max(1),
            lapped: end >= WHOLE,
            at_young: false,
        }
    }
}
