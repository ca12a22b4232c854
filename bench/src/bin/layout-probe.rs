//! A design probe for the run layout (`docs/perf-log.md`, "The run layout"): the storage the
//! plan describes, reduced to what W1M exercises, measured on W1M's data and queries with the
//! same method as `w1m`, so its figures sit next to the engine's and the peers' on one host.
//!
//! ```text
//! layout-probe [--chains N] [--queries N] [--no-hints] [--no-roots] [--no-gone] [--no-join] [--json]
//! ```
//!
//! This is not an index: one thread, one partition, keys of 8 bytes, replica indices below 64,
//! no LFU, TTL sweep or tiers beyond what the walk reads. Its key table is the engine's
//! (`inferencecache_engine::layout::SlotTable`: atomic slots, epoch-retired tables, a writer
//! lock, taken once per stretch here); its runs are plain memory, freed at once, which only a
//! single thread may do. It answers one question
//! before the engine is rebuilt around it: how fast are lookups, inserts and removals when a
//! key table slot names `(run, offset)` directly and a run holds its stretch's holders and keys
//! in one allocation, i.e. when a probe is one slot line and then the run's lines (header,
//! holders, keys) at addresses known from the slot alone. Every lookup's sums are checked
//! against W1M's expected answers, so the probe computes the same matches as the engine.
//!
//! Layout. A slot is `{key: u64, value: u64}` (16 bytes, four per line, linear probing over a
//! power-of-two table, grown at 3/4 load), with a presence summary of two bits per key in one
//! word per 32 slots. `value` is the run pointer with the block's offset in its top 16 bits and,
//! in bit 0, whether the key also has a root slot. A run is one allocation of words: its holder
//! entries (two words each, stored in reverse, with room for one more than it was built with),
//! four successor hints, the header (`holders | capacity << 16 | len << 32`, the count of slots
//! and hints naming the run, the dead bits of offsets 0–63, the gone bits of holders that left
//! it), the keys, then the dead words of offsets from 64 on. The run pointer points at the
//! header, so key `o` is at `header + 4 + o` whatever the holder count, and the holders and
//! hints sit in the lines just before it.
//!
//! Writes. A chain is cut into stretches by probing only each stretch's first key: the keys
//! after it are matched against the run's own keys (a live offset's slot names it, since a slot
//! is repointed or removed only after its offset is marked dead). A holder joining a run whose
//! live blocks the stretch covers takes the spare entry (`--no-join` turns that off); a holder
//! leaving such a run, when others stay, sets its gone bit (`--no-gone`); otherwise the stretch
//! is copied into a new run and its slots repointed, or removed with the last holder.
//!
//! Two lookup aids, each with a flag that turns it off for A/B runs: **successor hints**
//! (`--no-hints`; a run's `(key, value)` of the block after its stretch in the chains that
//! built it, used when the hinted offset is still live, so the walk fetches the next run while
//! it compares this one's keys) and **root slots** (`--no-roots`; a small table holding a copy
//! of the slot of every key an ingest began with, kept equal to the key table's by every write,
//! so block 0 usually costs no cold line). A hint here holds a reference to its target run;
//! the engine would check run ids by generation instead.

use std::process::ExitCode;

use clap::Parser;
use clap::builder::TypedValueParser;
use crossbeam_epoch as epoch;
use inferencecache_engine::layout::{SlotTable, SlotValue};
use std::time::Instant;

use inferencecache_bench::measure::{Plan, Recorder, Sums, bench_lookup, vm_rss_bytes};
use inferencecache_bench::w1m::{
    BLOCK_TOKENS, CHAINS_FULL, Chain, Kind, LEN, QUERIES, Queries, Workload, parse_chains, rolling,
    worker,
};

/// The probe's row name in tables and JSON lines; each aid turned off adds a suffix
/// (", no roots", ", no hints", ", no gone", ", no join").
const ROW: &str = "inferencecache run-layout probe";

/// How many keys ahead a write fetches slot lines while it probes or repoints.
const AHEAD: usize = 8;
/// An unused hint's key (the probe's keys are W1M's hashes, never 0).
const EMPTY: u64 = 0;
const OFFSET_SHIFT: u32 = 48;
const PTR_MASK: u64 = (1 << OFFSET_SHIFT) - 1;
/// Set in a key table slot value whose key also has a root slot (run pointers are 8-byte
/// aligned, so bit 0 is free): a write learns from the value it replaces whether the root slot
/// needs the same change, without probing the root table per key.
const ROOT_FLAG: u64 = 1;
/// Header words: holders and length, slot count, dead bits of offsets 0..64, gone holders.
const HEADER: usize = 4;
/// The header word whose bit `i` says holder `i` holds none of the run's blocks any more.
const GONE: usize = 3;
/// Successor hints per run (see `Run::hint`); `--no-hints` turns their use off, for A/B runs.
const HINTS: usize = 4;
const HINT_WORDS: usize = 2 * HINTS;
static USE_HINTS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
/// Whether a holder leaving a run whole is marked gone in place (`--no-gone` copies the run
/// without it instead, for A/B runs).
static USE_GONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
/// Whether runs keep a spare holder entry for a holder joining in place (`--no-join`).
static USE_JOIN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
/// Whether lookups try the root slots first (`--no-roots` turns it off, for A/B runs).
static USE_ROOTS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Holder entries a run built with `n` holders has room for: spare ones let a holder join a
/// run it covers whole in place (`--no-join` turns that off, for A/B runs).
fn holder_capacity(n: usize) -> usize {
    if USE_JOIN.load(std::sync::atomic::Ordering::Relaxed) {
        (n + 1).min(64)
    } else {
        n
    }
}

/// Dead-bit words a run of `len` blocks keeps after its keys (offsets from 64 on).
fn extra_dead_words(len: usize) -> usize {
    len.div_ceil(64).saturating_sub(1)
}

/// A holder: replica index and `last_seen` (ms) in `a`, tier in `b`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Holder {
    a: u64,
    b: u64,
}

impl Holder {
    fn rep(self) -> u32 {
        (self.a & 0xFFFFF) as u32
    }
}

/// A run: see the module docs for its layout.
#[derive(Clone, Copy)]
struct Run(*mut u64);

impl Run {
    fn create(holders: &[Holder], keys: &[u64]) -> Run {
        let cap = holder_capacity(holders.len());
        let words = 2 * cap + HINT_WORDS + HEADER + keys.len() + extra_dead_words(keys.len());
        let mut v = vec![0u64; words].into_boxed_slice();
        let h = 2 * cap + HINT_WORDS;
        for (i, x) in holders.iter().enumerate() {
            v[h - HINT_WORDS - 2 - 2 * i] = x.a;
            v[h - HINT_WORDS - 1 - 2 * i] = x.b;
        }
        v[h] = holders.len() as u64 | (cap as u64) << 16 | (keys.len() as u64) << 32;
        v[h + HEADER..h + HEADER + keys.len()].copy_from_slice(keys);
        let base = Box::into_raw(v) as *mut u64;
        // SAFETY: `h` is within the allocation of `words` words.
        Run(unsafe { base.add(h) })
    }

    fn n_holders(self) -> usize {
        // SAFETY: a run pointer points at its header word.
        unsafe { (*self.0 & 0xFFFF) as usize }
    }

    /// Holder entries the allocation has room for.
    fn capacity(self) -> usize {
        // SAFETY: as above.
        unsafe { (*self.0 >> 16 & 0xFFFF) as usize }
    }

    /// Adds `h` in the next spare holder entry (callers check there is one): the entry is
    /// written before the count that makes readers read it.
    fn push_holder(self, h: Holder) {
        let i = self.n_holders();
        // SAFETY: `i < capacity`, so entry `i` is inside the allocation; the probe is one
        // thread (the engine would store the count with Release after the entry).
        unsafe {
            *self.0.sub(HINT_WORDS + 2 + 2 * i) = h.a;
            *self.0.sub(HINT_WORDS + 1 + 2 * i) = h.b;
            *self.0 += 1;
        }
    }

    fn len(self) -> usize {
        // SAFETY: as above.
        unsafe { (*self.0 >> 32) as usize }
    }

    fn key(self, o: usize) -> u64 {
        // SAFETY: callers pass `o < len`.
        unsafe { *self.0.add(HEADER + o) }
    }

    fn holder(self, i: usize) -> Holder {
        // SAFETY: callers pass `i < n_holders`; holder `i` sits `2 (i + 1)` words before the
        // hints.
        unsafe {
            Holder {
                a: *self.0.sub(HINT_WORDS + 2 + 2 * i),
                b: *self.0.sub(HINT_WORDS + 1 + 2 * i),
            }
        }
    }

    fn hint_at(self, j: usize) -> *mut u64 {
        // SAFETY: hint `j < HINTS` is two words of the `HINT_WORDS` before the header.
        unsafe { self.0.sub(HINT_WORDS - 2 * j) }
    }

    /// The hinted `(run, offset)` of the block keyed `key` that follows one of this run's
    /// stretches, if a hint names it and the hinted offset is still live (then the key's slot
    /// names it: a slot is repointed or removed only after its offset is marked dead). A hint
    /// holds a reference to its run, so the run is still allocated.
    fn hint(self, key: u64) -> Option<u64> {
        for j in 0..HINTS {
            let e = self.hint_at(j);
            // SAFETY: `e` points at a hint's two words.
            let (k, v) = unsafe { (*e, *e.add(1)) };
            if k == key {
                let (r, o) = unpack(v);
                return (!r.is_dead(o)).then_some(v);
            }
        }
        None
    }

    /// Records that the block keyed `key` after one of this run's stretches is at `v` (its
    /// slot's value), replacing the hint for that key, else a free one, else one chosen by the
    /// key.
    fn add_hint(self, key: u64, v: u64, bytes: &mut usize) {
        let mut pick = None;
        for j in 0..HINTS {
            // SAFETY: as in `hint`.
            let k = unsafe { *self.hint_at(j) };
            if k == key {
                pick = Some(j);
                break;
            }
            if k == EMPTY && pick.is_none() {
                pick = Some(j);
            }
        }
        let j = pick.unwrap_or(key as usize % HINTS);
        let e = self.hint_at(j);
        let (target, _) = unpack(v);
        *target.refs() += 1;
        // SAFETY: as in `hint`; the probe is one thread, so nothing else reads or writes them.
        let (old, old_v) = unsafe {
            (
                std::mem::replace(&mut *e, key),
                std::mem::replace(&mut *e.add(1), v),
            )
        };
        if old != EMPTY {
            unpack(old_v).0.release(1, bytes);
        }
    }

    fn is_dead(self, o: usize) -> bool {
        // SAFETY: `o < len` for a hinted offset.
        unsafe { *self.dead_word(o / 64) >> (o % 64) & 1 == 1 }
    }

    /// The holders that still hold the run's blocks.
    fn holders(self) -> Vec<Holder> {
        let gone = self.gone();
        (0..self.n_holders())
            .filter(|i| gone >> i & 1 == 0)
            .map(|i| self.holder(i))
            .collect()
    }

    fn gone(self) -> u64 {
        // SAFETY: word `GONE` of the header.
        unsafe { *self.0.add(GONE) }
    }

    /// Marks holder `i` as holding none of the run's blocks: its removal from a run it leaves
    /// whole, with no new run and no slot writes.
    fn set_gone(self, i: usize) {
        // SAFETY: as in `gone`; the probe is one thread.
        unsafe { *self.0.add(GONE) |= 1 << i }
    }

    /// Offsets whose slot still names this run.
    fn live_count(self) -> usize {
        let dead: u32 = (0..self.len().div_ceil(64))
            // SAFETY: `w` < ⌈len / 64⌉.
            .map(|w| unsafe { (*self.dead_word(w)).count_ones() })
            .sum();
        self.len() - dead as usize
    }

    fn refs(self) -> &'static mut u64 {
        // SAFETY: word 1 after the header is the run's slot count; the probe is one thread.
        unsafe { &mut *self.0.add(1) }
    }

    fn words(self) -> usize {
        2 * self.capacity() + HINT_WORDS + HEADER + self.len() + extra_dead_words(self.len())
    }

    /// Dead word `w`: the header's for offsets 0..64, then the words after the keys.
    fn dead_word(self, w: usize) -> *mut u64 {
        // SAFETY: word 2 of the header, or one of the `extra_dead_words` after the keys.
        unsafe {
            if w == 0 {
                self.0.add(2)
            } else {
                self.0.add(HEADER + self.len() + w - 1)
            }
        }
    }

    fn bytes(self) -> usize {
        self.words() * 8
    }

    /// The first offset after `o` whose slot no longer names this run (or `len`).
    fn live_end(self, o: usize) -> usize {
        let len = self.len();
        let mut w = (o + 1) / 64;
        let mut bits = if o + 1 >= len {
            return len;
        } else {
            // SAFETY: `w` < ⌈len / 64⌉.
            unsafe { *self.dead_word(w) >> ((o + 1) % 64) << ((o + 1) % 64) }
        };
        loop {
            if bits != 0 {
                return (w * 64 + bits.trailing_zeros() as usize).min(len);
            }
            w += 1;
            if w * 64 >= len {
                return len;
            }
            // SAFETY: as above.
            bits = unsafe { *self.dead_word(w) };
        }
    }

    /// Marks offset `o` as no longer named by its slot (replaced or removed).
    fn set_dead(self, o: usize) {
        // SAFETY: `o < len`, so its dead word exists.
        unsafe {
            *self.dead_word(o / 64) |= 1 << (o % 64);
        }
    }

    /// Drops one slot's reference; frees the run with its last.
    fn release(self, n: u64, bytes: &mut usize) {
        let r = self.refs();
        *r -= n;
        if *r == 0 {
            *bytes -= self.bytes();
            for j in 0..HINTS {
                let e = self.hint_at(j);
                // SAFETY: as in `hint`.
                let (k, v) = unsafe { (*e, *e.add(1)) };
                if k != EMPTY {
                    unpack(v).0.release(1, bytes);
                }
            }
            let h = 2 * self.capacity() + HINT_WORDS;
            let words = self.words();
            // SAFETY: the allocation was a boxed slice of `words` words starting `h` words
            // before the header, and no slot names it any more.
            unsafe {
                let base = self.0.sub(h);
                drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                    base, words,
                )));
            }
        }
    }

    fn prefetch(self, o: usize) {
        // Header, the lines of the hints and holders before it, and key `o`'s line.
        prefetch(self.0 as *const u8);
        prefetch(self.0.wrapping_sub(8) as *const u8);
        prefetch(self.0.wrapping_sub(16) as *const u8);
        prefetch(self.0.wrapping_add(HEADER + o) as *const u8);
    }
}

#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetching never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

fn pack(run: Run, o: usize) -> u64 {
    run.0 as u64 | (o as u64) << OFFSET_SHIFT
}

fn unpack(v: u64) -> (Run, usize) {
    (
        Run((v & PTR_MASK & !ROOT_FLAG) as *mut u64),
        (v >> OFFSET_SHIFT) as usize,
    )
}

/// A slot value: the run pointer with the offset in the top bits (never 0).
fn slot(v: u64) -> SlotValue {
    SlotValue::new(v).expect("a run pointer is not null")
}

/// One partition's storage.
struct Probe {
    /// The key table: the engine's key-inline slot table (`layout::SlotTable`).
    table: SlotTable,
    /// Root slots: a copy of the slot of every key an ingest began with, kept equal to the
    /// key table's by every write, in a table small enough to stay cached (W1M: 2,048 keys),
    /// so a lookup's block 0 usually costs no cold line.
    roots: SlotTable,
    run_bytes: usize,
    /// A removal's stretch in offset order (reused).
    ordered: Vec<u64>,
}

/// Where a chain's stretch stands in the table: the slots of consecutive blocks that name
/// consecutive offsets of one run (or are absent).
enum Stretch {
    Fresh {
        from: usize,
        to: usize,
    },
    InRun {
        from: usize,
        to: usize,
        run: Run,
        /// The keys name decreasing offsets (a chain given tail to head).
        descending: bool,
    },
}

impl Probe {
    fn new() -> Self {
        Probe {
            table: SlotTable::new(),
            roots: SlotTable::new(),
            run_bytes: 0,
            ordered: Vec::new(),
        }
    }

    fn new_run(&mut self, holders: &[Holder], keys: &[u64], slots: u64) -> Run {
        let r = Run::create(holders, keys);
        *r.refs() = slots;
        self.run_bytes += r.bytes();
        r
    }

    /// Splits `keys` into stretches: maximal runs of absent keys, and maximal runs of keys that
    /// name consecutive offsets of one run (`vals` gets each present key's slot value, root flag
    /// left out). Only a stretch's first key is probed: the keys after it are matched against
    /// the run's own keys, since a live offset's key has its slot naming that offset (a slot is
    /// repointed or removed only after its old offset is marked dead). Absent keys are probed
    /// with the ones after them fetched ahead, as their insert will probe them again.
    fn stretches(&self, keys: &[u64], vals: &mut Vec<Option<u64>>) -> Vec<Stretch> {
        vals.clear();
        let guard = epoch::pin();
        let mut out = Vec::new();
        // Keys below `fetched` have had their slot lines prefetched.
        let mut fetched = 0;
        let mut i = 0;
        // The probe of `keys[i]` when a fresh stretch's loop made it already.
        let mut carried = None;
        while i < keys.len() {
            let found = carried
                .take()
                .unwrap_or_else(|| self.table.find(keys[i], &guard).map(SlotValue::get));
            let Some(v) = found else {
                let from = i;
                loop {
                    vals.push(None);
                    i += 1;
                    let ahead = (i + AHEAD).min(keys.len());
                    for k in &keys[fetched.max(i)..ahead] {
                        self.table.prefetch(*k, &guard);
                    }
                    fetched = fetched.max(ahead);
                    if i == keys.len() {
                        break;
                    }
                    if let Some(v) = self.table.find(keys[i], &guard) {
                        carried = Some(Some(v.get()));
                        break;
                    }
                }
                out.push(Stretch::Fresh { from, to: i });
                continue;
            };
            let (run, o) = unpack(v);
            let from = i;
            vals.push(Some(pack(run, o)));
            i += 1;
            let live = |p: usize| p < run.len() && !run.is_dead(p);
            let descending = i < keys.len()
                && o > 0
                && live(o - 1)
                && run.key(o - 1) == keys[i]
                && !(live(o + 1) && run.key(o + 1) == keys[i]);
            while i < keys.len() {
                let step = i - from;
                let p = if descending {
                    match o.checked_sub(step) {
                        Some(p) => p,
                        None => break,
                    }
                } else {
                    o + step
                };
                if !live(p) || run.key(p) != keys[i] {
                    break;
                }
                vals.push(Some(pack(run, p)));
                i += 1;
            }
            out.push(Stretch::InRun {
                from,
                to: i,
                run,
                descending,
            });
        }
        out
    }

    /// One chain ingest of replica `rep` at `ts_ms`.
    fn ingest(&mut self, rep: u32, ts_ms: i64, keys: &[u64], vals: &mut Vec<Option<u64>>) {
        let me = Holder {
            a: (ts_ms as u64) << 20 | u64::from(rep),
            b: 0,
        };
        // The run that holds each stretch once the ingest is done, and where the stretch ends.
        let mut owners: Vec<(Run, usize)> = Vec::new();
        let stretches = self.stretches(keys, vals);
        for s in stretches {
            match s {
                Stretch::Fresh { from, to } => {
                    let run = self.new_run(&[me], &keys[from..to], (to - from) as u64);
                    let guard = epoch::pin();
                    let mut w = self.table.lock();
                    for (o, k) in keys[from..to].iter().enumerate() {
                        w.insert(*k, slot(pack(run, o)), &guard);
                    }
                    owners.push((run, to));
                }
                Stretch::InRun { from, to, run, .. } => {
                    let mut hs = run.holders();
                    match hs.iter().position(|h| h.rep() == rep) {
                        Some(i) if hs[i] == me => {
                            owners.push((run, to));
                            continue;
                        }
                        Some(i) => hs[i] = me,
                        None if run.n_holders() < run.capacity()
                            && to - from == run.live_count() =>
                        {
                            run.push_holder(me);
                            owners.push((run, to));
                            continue;
                        }
                        None => hs.push(me),
                    }
                    let new = self.new_run(&hs, &keys[from..to], (to - from) as u64);
                    // The new run ends where the old run's stretch did, or before the old
                    // run's next live block: it inherits the old run's hints, or hints at
                    // that block.
                    let (_, o_from) = unpack(vals[from].expect("present key"));
                    let end = o_from + (to - from);
                    if end == run.len() {
                        for j in 0..HINTS {
                            // SAFETY: hint words of a live run.
                            let (k, v) = unsafe { (*run.hint_at(j), *run.hint_at(j).add(1)) };
                            if k != EMPTY {
                                new.add_hint(k, v, &mut self.run_bytes);
                            }
                        }
                    } else if !run.is_dead(end) {
                        new.add_hint(run.key(end), pack(run, end), &mut self.run_bytes);
                    }
                    self.repoint(&keys[from..to], &vals[from..to], run, Some(new));
                    owners.push((new, to));
                }
            }
        }
        let guard = epoch::pin();
        if let Some(k) = keys.first()
            && let Some(v) = self.table.find(*k, &guard)
            && v.get() & ROOT_FLAG == 0
        {
            let flagged = slot(v.get() | ROOT_FLAG);
            self.table.lock().insert(*k, flagged, &guard);
            self.roots.lock().insert(*k, flagged, &guard);
        }
        // Each stretch's run hints at the block after it, as the ingest left it.
        for w in owners.windows(2) {
            let (run, to) = w[0];
            if let Some(v) = self.table.find(keys[to], &guard) {
                run.add_hint(keys[to], v.get(), &mut self.run_bytes);
            }
        }
    }

    /// Points the slots of `keys` (consecutive offsets of `old`, whose slot values are `olds`)
    /// at the same offsets of `new` from 0, or removes them; marks each old offset dead before
    /// its slot changes, and releases them.
    fn repoint(&mut self, keys: &[u64], olds: &[Option<u64>], old: Run, new: Option<Run>) {
        let guard = epoch::pin();
        for k in keys.iter().take(AHEAD) {
            self.table.prefetch(*k, &guard);
        }
        let mut w = self.table.lock();
        for (o, (k, was)) in keys.iter().zip(olds).enumerate() {
            if let Some(n) = keys.get(o + AHEAD) {
                self.table.prefetch(*n, &guard);
            }
            let (_, old_o) = unpack(was.expect("present key"));
            old.set_dead(old_o);
            let replaced = match new {
                Some(r) => w.insert(*k, slot(pack(r, o)), &guard),
                None => w.remove(*k, &guard),
            };
            if replaced.is_some_and(|v| v.get() & ROOT_FLAG != 0) {
                let mut roots = self.roots.lock();
                match new {
                    Some(r) => {
                        let flagged = slot(pack(r, o) | ROOT_FLAG);
                        w.insert(*k, flagged, &guard);
                        roots.insert(*k, flagged, &guard);
                    }
                    None => {
                        roots.remove(*k, &guard);
                    }
                }
            }
        }
        drop(w);
        old.release(keys.len() as u64, &mut self.run_bytes);
    }

    /// PREFIX_EVICTED of `keys` for replica `rep`.
    fn evict(&mut self, rep: u32, keys: &[u64], vals: &mut Vec<Option<u64>>) {
        for s in self.stretches(keys, vals) {
            let Stretch::InRun {
                from,
                to,
                run,
                descending,
            } = s
            else {
                continue;
            };
            let mut ordered = std::mem::take(&mut self.ordered);
            ordered.clear();
            ordered.extend_from_slice(&keys[from..to]);
            let mut olds: Vec<Option<u64>> = vals[from..to].to_vec();
            if descending {
                ordered.reverse();
                olds.reverse();
            }
            let gone = run.gone();
            let Some(at) =
                (0..run.n_holders()).find(|&i| gone >> i & 1 == 0 && run.holder(i).rep() == rep)
            else {
                continue;
            };
            let others = (run.n_holders() - gone.count_ones() as usize) > 1;
            if others
                && USE_GONE.load(std::sync::atomic::Ordering::Relaxed)
                && to - from == run.live_count()
            {
                run.set_gone(at);
                continue;
            }
            let mut hs = run.holders();
            hs.retain(|h| h.rep() != rep);
            let new = (!hs.is_empty()).then(|| self.new_run(&hs, &ordered, (to - from) as u64));
            self.repoint(&ordered, &olds, run, new);
            self.ordered = ordered;
        }
    }

    /// The longest-prefix match (L4) over `hashes` with `counts`, live holders only: per
    /// replica (index < 64) the matched tokens and blocks; returns the check sums
    /// `[Σ blocks, Σ tokens, replicas]`.
    fn lookup(&self, hashes: &[u64], counts: &[i32], now_ms: i64, ttl_ms: i64) -> Sums {
        let n = hashes.len().min(counts.len());
        if n == 0 {
            return [0; 3];
        }
        let guard = epoch::pin();
        let root = if USE_ROOTS.load(std::sync::atomic::Ordering::Relaxed) {
            self.roots.find(hashes[0], &guard)
        } else {
            None
        };
        let Some(v) = root
            .or_else(|| self.table.find(hashes[0], &guard))
            .map(SlotValue::get)
        else {
            return [0; 3];
        };
        let (mut run, mut o) = unpack(v);
        run.prefetch(o);
        let mut open = 0u64;
        let mut sums = [0u64; 3];
        let mut tokens = 0i64;
        let mut pos = 0usize;
        let mut first = true;
        loop {
            // The block at `pos` is held by exactly `run`'s holders: close the open replicas
            // it lacks (at the tokens before it) and, at block 0, open the live ones.
            let mut here = 0u64;
            let gone = run.gone();
            for i in 0..run.n_holders() {
                if gone >> i & 1 == 1 {
                    continue;
                }
                let h = run.holder(i);
                let age = now_ms - (h.a >> 20) as i64;
                if age < ttl_ms {
                    here |= 1 << h.rep();
                }
            }
            if first {
                open = here;
                first = false;
            }
            let closing = open & !here;
            if closing != 0 {
                let c = u64::from(closing.count_ones());
                sums[0] += c * pos as u64;
                sums[1] += c * tokens as u64;
                sums[2] += c;
                open &= here;
            }
            if open == 0 {
                return sums;
            }
            tokens += i64::from(counts[pos]);
            // Step over the run's next keys while they are the request's. Where the stretch
            // ends is the next probe, if the request follows the stretch that far: a successor
            // hint of the run that names the landing key (verified: the hinted offset is still
            // live, so the key's slot names it) gives it without the table, and its run's
            // lines are fetched while the keys are compared; otherwise the landing slot is.
            let max = (run.live_end(o) - o - 1).min(n - pos - 1);
            let landing = pos + 1 + max;
            let mut ahead = None;
            if let Some(&k) = hashes.get(landing) {
                if USE_HINTS.load(std::sync::atomic::Ordering::Relaxed)
                    && let Some(v) = run.hint(k)
                {
                    let (r, ro) = unpack(v);
                    r.prefetch(ro);
                    ahead = Some(v);
                } else {
                    self.table.prefetch(k, &guard);
                }
            }
            let mut m = 0;
            while m < max && hashes[pos + 1 + m] == run.key(o + 1 + m) {
                tokens += i64::from(counts[pos + 1 + m]);
                m += 1;
            }
            pos += m + 1;
            let next = if pos >= n {
                None
            } else if m == max
                && let Some(v) = ahead
            {
                Some(v)
            } else {
                self.table.find(hashes[pos], &guard).map(SlotValue::get)
            };
            match next {
                Some(v) => {
                    (run, o) = unpack(v);
                    run.prefetch(o);
                }
                None => {
                    let c = u64::from(open.count_ones());
                    sums[0] += c * pos as u64;
                    sums[1] += c * tokens as u64;
                    sums[2] += c;
                    return sums;
                }
            }
        }
    }
}

fn expected(kind: Kind) -> Sums {
    [
        kind.blocks_per_query(),
        kind.tokens_per_query(),
        kind.replicas_per_query(),
    ]
}

/// The run-layout design probe on W1M: load the workload, time the query sets and removals,
/// check every answer (exit 1 when a check fails).
#[derive(Debug, Parser)]
#[command(name = "layout-probe", version)]
struct Args {
    /// Chains of the workload (default: the full W1M size).
    #[arg(long, default_value_t = CHAINS_FULL, value_parser = parse_chains)]
    chains: usize,
    /// Queries per query set (default: W1M's).
    #[arg(long, default_value_t = QUERIES, value_parser = clap::value_parser!(u64).range(1..).map(|v| v as usize))]
    queries: usize,
    /// Lookups do not use the successor hints.
    #[arg(long)]
    no_hints: bool,
    /// Lookups do not try the root slots for block 0.
    #[arg(long)]
    no_roots: bool,
    /// A holder leaving a run whole is removed by copying the run without it, not marked gone
    /// in place.
    #[arg(long)]
    no_gone: bool,
    /// Runs keep no spare holder entry: a holder joining a run is added by copying the run.
    #[arg(long)]
    no_join: bool,
    /// Print one JSON line per figure instead of the table.
    #[arg(long)]
    json: bool,
}

fn run(args: &Args) -> Result<(), String> {
    let (chains, queries) = (args.chains, args.queries);
    USE_ROOTS.store(!args.no_roots, std::sync::atomic::Ordering::Relaxed);
    USE_HINTS.store(!args.no_hints, std::sync::atomic::Ordering::Relaxed);
    USE_GONE.store(!args.no_gone, std::sync::atomic::Ordering::Relaxed);
    USE_JOIN.store(!args.no_join, std::sync::atomic::Ordering::Relaxed);
    let w = Workload::new(chains);
    let q = Queries::generate(chains, queries);
    let counts = [BLOCK_TOKENS; LEN];
    let now_ms = 1_700_000_000_000i64;
    let ttl_ms = 1_800_000i64;

    let rss0 = vm_rss_bytes();
    let mut p = Probe::new();
    let mut vals = Vec::with_capacity(LEN);
    let t = Instant::now();
    for (c, s) in w.seq.iter().enumerate() {
        p.ingest(worker(c) as u32, now_ms, s, &mut vals);
    }
    let insert = t.elapsed();
    let rss = vm_rss_bytes().saturating_sub(rss0);
    let entries = w.entries() as f64;
    let accounted = {
        let guard = epoch::pin();
        p.table.memory_bytes(&guard) + p.roots.memory_bytes(&guard) + p.run_bytes
    };

    let mut rows = Vec::new();
    for set in [&q.q50, &q.q100, &q.q0] {
        let qs: Vec<Chain> = set.blocks.iter().map(rolling).collect();
        let st = bench_lookup(
            set.kind.label(),
            qs.len(),
            Plan::FULL,
            expected(set.kind),
            |i| p.lookup(&qs[i], &counts, now_ms, ttl_ms),
        )?;
        rows.push((set.kind.label(), st));
    }

    let t = Instant::now();
    for (c, s) in w.seq.iter().enumerate() {
        let mut rev = *s;
        rev.reverse();
        p.evict(worker(c) as u32, &rev, &mut vals);
    }
    let remove = t.elapsed();
    if !p.table.is_empty() || !p.roots.is_empty() || p.run_bytes != 0 {
        return Err(format!(
            "remove left {} keys, {} root slots and {} run bytes",
            p.table.len(),
            p.roots.len(),
            p.run_bytes
        ));
    }

    let mut row = ROW.to_string();
    for (off, suffix) in [
        (args.no_roots, ", no roots"),
        (args.no_hints, ", no hints"),
        (args.no_gone, ", no gone"),
        (args.no_join, ", no join"),
    ] {
        if off {
            row.push_str(suffix);
        }
    }
    let row = row.as_str();
    let mut rec = Recorder::default();
    rec.put_write(row, "insert", w.entries(), insert);
    rec.put_write(row, "remove", w.entries(), remove);
    rec.put(row, "rss_b_entry", rss as f64 / entries, "B");
    rec.put(row, "mem_b_entry", accounted as f64 / entries, "B");
    for (label, st) in &rows {
        rec.put_lookup(row, label, st);
    }
    if args.json {
        rec.print_json(&format!(",\"chains\":{chains},\"queries\":{queries}"));
    } else {
        println!(
            "layout-probe: {chains} chains, {} entries, {queries} queries/set",
            w.entries()
        );
        rec.print_table();
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("layout-probe: {e}");
            ExitCode::FAILURE
        }
    }
}
