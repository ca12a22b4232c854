//! One partition's storage (`docs/engine.md`, "Storage: the run layout"): the key-inline slot
//! table naming `(run, offset)`, the [`BlockRun`]s the slots name, their ids, and the root
//! slots. `tests` below compare it with a plain map after random ingests and removals; the
//! design probe (`bench/src/bin/layout-probe.rs`) runs W1M on it without the index.
//!
//! # Writes
//!
//! A write takes the store's writer lock once, for the whole chain. What the store keeps
//! between writes behind that lock is small (`StoreState`: the run-id allocator, the entry
//! generation, a seed); the write's scratch vectors belong to the writing thread (a
//! thread-local `StoreWriter` the state is moved into for the write, `WriterGuard`), so a
//! partition carries no scratch buffers of its own. It cuts the chain into
//! *stretches*, probing only each stretch's first key: a stretch is a maximal run of absent
//! keys, or of keys naming consecutive offsets of one run (forwards, or for a removal either
//! direction), and an ingest's stretch keeps its run's token counts affine (`block_run`,
//! "Token counts": after its first block, each block's own count is the run's step, an absent
//! stretch taking its second block's). The keys after a stretch's first are matched against the
//! run's own keys, which is exact by `block_run`'s invariant 2 (a live offset's slot names
//! it). Then, per stretch:
//!
//! - **absent**: one new run held by the writing replica, its slots inserted;
//! - **unchanged** (the replica holds it with the same state): nothing;
//! - **join** (the replica is not among the holders, the run has a spare entry and the stretch
//!   covers every live offset of it): the spare entry, no slot writes;
//! - **leave** (a removal of one of several holders, covering every live offset): the gone bit;
//! - otherwise **copy on write**: a new run over the stretch with the changed holders, each old
//!   offset marked dead before its slot is repointed (or removed with the last holder).
//!
//! A run whose last reference goes is retired through the epoch. After an ingest, each of its
//! stretches' runs hints at the block after it ([`BlockRun::set_hint`]), and a run copied on
//! write inherits the old run's hints when it ends where that one did, else hints at the old
//! run's next live block. A chain that repeats a key is written key by key (its repeated keys
//! would make two offsets claim one slot); the last occurrence wins, as for any chain. An
//! ingest finds repeats in the chain's digests (a seeded set, linear in the chain); a removal
//! only needs to rule out two stretches naming one held block, which its cut shows directly.
//!
//! Writes report what the index's derived counters need ([`IngestReport`], [`EvictReport`]):
//! blocks a replica gained or lost, keys that appeared or went; their `_with` forms also call
//! back once per entry added or removed, with its holder entry (the change events, N1, and
//! what an entry's generation keys: LFU cells, cap victims), in chain order for a chain write,
//! under the writer lock. A removal calls back *before* readers can see the entry gone, so a
//! count the callback lowers is lower for whoever sees the removal.
//! Counts and calls follow what was written: a stretch left as it was because no run could be
//! built for it counts as dropped (ingest) or not at all (removal). [`RunStore::remove_holders`]
//! (the TTL sweep, ALL_CLEARED) removes the holders it picks run by run, each over the run's
//! live offsets; [`RunStore::remove_keys`] (a quota's victims) removes whole keys;
//! [`RunStore::for_each_key`] lists every present key with the run naming it, and
//! [`RunStore::scan`] a stretch of them from a cursor (a sampling hand); the cap's victim, one
//! replica's copy of a run, goes through [`RunStore::remove_run_holder_with`].
//!
//! # Keys of other lengths
//!
//! Chains come as [`Keys`]: digests, and the keys' bytes when some may not be 8 bytes long.
//! Slots and runs are keyed by digest; a long run keeps its keys' bytes (`block_run`, "Keys
//! of other lengths"), and every place a key is taken for another (a slot or a hint at block 0
//! or a landing, a run's next keys in a walk or a write's stretch) compares the long parts
//! too. A key whose digest another present key holds is such a mismatch: a walk stops before
//! it, an ingest leaves it out ([`IngestReport::dropped`]), a removal finds nothing of it. A
//! chain of 8-byte keys pays one header bit test per run for this.
//!
//! # Root slots
//!
//! A second, small slot table holds a copy of the slot of every key an ingest began with; bit 0
//! of a key table value ([`FLAG`]) says the key has one, so a write learns it from the value it
//! replaces and keeps the copy equal, and every root is a key of the key table. A walk looks
//! block 0 up there once the key table's summary word admits the key (most absent keys stop at
//! that word), so its first line is usually cached.
//!
//! # Walk
//!
//! Probe block 0 (the key table's summary word, the root slots, then the key table), then compare
//! the request's next keys with the run's keys up to its next dead offset or its end; at the
//! landing, a hint of the run just left gives the next slot value without the table, else the key
//! table does. The hint is read before the keys are compared and the run it names fetched then, but
//! it is checked (which reads that run) only after the compare and the caller's visit, so its lines
//! come in meanwhile instead of being waited for. The hint's span says where the walk will likely
//! land after the hinted stretch, so the span's key lines and the key table's summary word for the
//! request's key there are fetched then too: a request that leaves the stored chain right after it
//! (its key is absent, which that word usually settles) finds it in cache. Each run's holders hold
//! every block of its stretch with the same state, so the caller merges holders once per stretch.
//!
//! # Trimming
//!
//! A run keeps the keys of its dead offsets (readers may still compare them) until it is
//! retired. So that a run whose blocks go one by one (an engine evicting a chain from its tail)
//! does not keep them while its head lives, a write that leaves a run with at most one live
//! offset in [`TRIM_RATIO`] (and at least that many offsets) copies it, at the write's end,
//! onto one new run per stretch of consecutive live offsets, with its live holders (their
//! token counts moved to the stretch's first offset) and its hints, and repoints their slots
//! as any copy on write does. A run whose live stretches would cost more bytes as runs of their
//! own than it does stays as it is. So a run's dead offsets number less than three times its
//! live ones (or at most three), or the run costs no more than its live stretches would on
//! their own, and the copies cost a write at most a third of the offsets it killed.
//!
//! # Limits
//!
//! A run holds at most [`MAX_HOLDERS`] (65,535) holder entries: an ingest that would give a
//! stretch more holders than that leaves it as it was and counts the blocks in
//! [`IngestReport::dropped`]. A holder joining a run without a spare entry copies it, so `n`
//! replicas joining one shared stretch one by one copy `O(n²)` holder entries in all.

use crate::raw::block_run::{
    BlockRun, FLAG, HintTarget, IdAllocator, MAX_HOLDERS, MAX_LEN, RunIds, ScanStep, pack, unpack,
};
use crate::raw::holder::{GEN_MASK, Holder};
use crate::raw::key::{KeyBytes, Keys, Request, one_key};
use crate::raw::reaper::Reaper;
use crate::raw::slots::{Probe, SlotTable, SlotValue, SlotWriter, home, random_seed};
use crate::sync::{AtomicU64, Mutex, Ordering};
use crossbeam_epoch::Guard;
use std::ptr::NonNull;
use std::sync::Arc;

/// How many keys ahead a write fetches slot lines while it probes or repoints.
const AHEAD: usize = 8;

/// Most key-table slots a walk that removes visits under one hold of the writer lock (C5).
pub const SLICE: usize = 4096;

/// A run is trimmed once at most one in this many of its offsets is live.
const TRIM_RATIO: usize = 4;

/// Switches for measuring the layout's aids one by one (`bench/src/bin/layout-probe.rs`); all
/// on by default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreOptions {
    /// Walks use the runs' successor hints.
    pub hints: bool,
    /// Walks try the root slots for block 0.
    pub roots: bool,
    /// A holder leaving a run it covers whole sets its gone bit (else the run is copied).
    pub gone: bool,
    /// Runs keep a spare holder entry for a holder joining in place (else the run is copied).
    pub join: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            hints: true,
            roots: true,
            gone: true,
            join: true,
        }
    }
}

/// What a chain ingest did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IngestReport {
    /// Blocks the replica did not hold before.
    pub added: usize,
    /// Blocks whose holder state changed (tier, token count, `last_seen`).
    pub refreshed: usize,
    /// Blocks left as they were because their run holds [`MAX_HOLDERS`] holders already.
    pub dropped: usize,
    /// Keys that were absent (a subset of `added`).
    pub new_keys: usize,
}

/// What a removal did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EvictReport {
    /// Blocks the replica held and no longer holds.
    pub removed: usize,
    /// Keys that became absent (their last holder went; a subset of `removed`).
    pub keys_removed: usize,
}

impl std::ops::AddAssign for EvictReport {
    fn add_assign(&mut self, other: Self) {
        self.removed += other.removed;
        self.keys_removed += other.keys_removed;
    }
}

/// The replica state an ingest writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Writing {
    /// The replica's index in its scope.
    pub rep: u32,
    /// Tier code 1..=4.
    pub tier: u8,
    /// The write's time (ms since the epoch).
    pub ts_ms: i64,
}

/// Whether key `i` of `keys` is key `o` of `run` (digest and long part).
#[inline]
fn key_is_at(keys: &impl Request, i: usize, run: &BlockRun, o: usize) -> bool {
    run.is_key(o, keys.digest(i), keys.long(i))
}

/// The other live keys of the run an entry is in (its *run mates*: entries of the same holder
/// entry, so of one age; the cap takes them together), as [`RunStore::remove_entry_if`] shows
/// them to its decision.
pub struct RunMates<'g> {
    run: &'g BlockRun,
    offset: usize,
}

impl RunMates<'_> {
    /// Calls `f` with each run mate's key.
    pub fn for_each(&self, mut f: impl FnMut(KeyBytes<'_>)) {
        let run = self.run;
        for p in (0..run.len()).filter(|&p| p != self.offset && !run.is_dead(p)) {
            f(KeyBytes::new(run.key(p), run.long_key(p)));
        }
    }
}

/// The keys of `run` at `offsets`, for a new run over them: their digests into `digests` and,
/// if the run is long, their bytes (returned).
fn copy_keys<'g>(
    run: &'g BlockRun,
    offsets: impl Iterator<Item = usize>,
    digests: &mut Vec<u64>,
) -> Option<Vec<KeyBytes<'g>>> {
    digests.clear();
    let mut bytes = run.is_long().then(Vec::new);
    for o in offsets {
        let digest = run.key(o);
        digests.push(digest);
        if let Some(bytes) = &mut bytes {
            bytes.push(KeyBytes::new(digest, run.long_key(o)));
        }
    }
    bytes
}

/// One partition's storage (see the module docs).
pub struct RunStore {
    table: SlotTable,
    roots: SlotTable,
    ids: RunIds,
    writer: Mutex<StoreState>,
    /// Bytes of the live runs (written by the writer-lock holder).
    run_bytes: AtomicU64,
    /// Retired runs past their grace period; the writers free them (`raw/reaper.rs`).
    reaper: Arc<Reaper<BlockRun>>,
    options: StoreOptions,
}

/// What a store keeps between its writes, behind its writer lock: the run-id allocator, the
/// entry generation, the placement seed of [`has_repeats`], and the runs a write left sparse
/// (empty between writes: a write trims them before it ends).
#[derive(Default)]
struct StoreState {
    alloc: IdAllocator,
    generation: u32,
    seed: u64,
    sparse: Vec<NonNull<BlockRun>>,
}

// SAFETY: `sparse` is empty between writes, and while a write runs it names runs of this store
// only for the writer-lock holder; the runs are `Sync` (`BlockRun`'s shared words are atomic).
unsafe impl Send for StoreState {}

/// One write's state: the store's [`StoreState`], moved in when the writer lock is taken and
/// back when it is released ([`WriterGuard`]), and the write's scratch vectors. The scratch
/// belongs to the writing thread (this struct lives in a thread-local between writes, its
/// vectors emptied with their capacity kept), not to the store: a partition costs no scratch
/// buffers and no vector headers of its own. Kept per store, they were ~550 bytes of every
/// partition of one 2-block chain (issue 42's churned tenants). Every user clears a scratch
/// vector before it fills it.
#[derive(Default)]
struct StoreWriter {
    alloc: IdAllocator,
    /// The next entry generation.
    generation: u32,
    /// Per chain key: its slot value when the write began (flag cleared), if present.
    values: Vec<Option<u64>>,
    stretches: Vec<Stretch>,
    /// Each stretch's run after the write and the position after the stretch.
    owners: Vec<(NonNull<BlockRun>, usize)>,
    /// A stretch's keys in old-offset order, and their values (removals).
    ordered: Vec<u64>,
    ordered_values: Vec<Option<u64>>,
    /// Scratch of [`has_repeats`].
    seen: Vec<u64>,
    /// Placement seed of `seen`.
    seed: u64,
    /// A stretch's holders after the write.
    holders: Vec<Holder>,
    /// The chain's cumulative token counts (an ingest).
    cumulative: Vec<i32>,
    /// Runs a release of this write left sparse, trimmed when the write ends.
    sparse: Vec<NonNull<BlockRun>>,
}

impl StoreWriter {
    /// Empties the scratch vectors (keeping their capacity): no run pointer of one store's
    /// write stays in a buffer another store's write gets.
    fn clear_scratch(&mut self) {
        self.values.clear();
        self.stretches.clear();
        self.owners.clear();
        self.ordered.clear();
        self.ordered_values.clear();
        self.seen.clear();
        self.holders.clear();
        self.cumulative.clear();
    }
}

std::thread_local! {
    /// The thread's [`StoreWriter`] while it holds no writer lock (its scratch buffers; the
    /// store's fields are moved out). `Cell::take` leaves a fresh one, so a thread holding two
    /// writer locks at once (none does) gives the second write empty buffers of its own.
    static WRITER: std::cell::Cell<StoreWriter> = std::cell::Cell::new(StoreWriter::default());
}

/// A held writer lock: the store's [`StoreState`] moved into the thread's [`StoreWriter`];
/// dropping it (also while unwinding) moves the state back and the scratch, emptied, to the
/// thread.
struct WriterGuard<'a> {
    state: crate::sync::MutexGuard<'a, StoreState>,
    writer: StoreWriter,
}

impl<'a> WriterGuard<'a> {
    fn new(mut state: crate::sync::MutexGuard<'a, StoreState>) -> Self {
        // `try_with`: a thread whose locals are being destroyed writes with fresh buffers.
        let mut writer = WRITER.try_with(std::cell::Cell::take).unwrap_or_default();
        writer.alloc = std::mem::take(&mut state.alloc);
        writer.generation = state.generation;
        writer.seed = state.seed;
        writer.sparse = std::mem::take(&mut state.sparse);
        Self { state, writer }
    }
}

impl Drop for WriterGuard<'_> {
    fn drop(&mut self) {
        let mut writer = std::mem::take(&mut self.writer);
        self.state.alloc = std::mem::take(&mut writer.alloc);
        self.state.generation = writer.generation;
        self.state.sparse = std::mem::take(&mut writer.sparse);
        writer.clear_scratch();
        // A thread whose locals are gone drops the buffers here instead.
        let _ = WRITER.try_with(|cell| cell.set(writer));
    }
}

impl std::ops::Deref for WriterGuard<'_> {
    type Target = StoreWriter;
    fn deref(&self) -> &StoreWriter {
        &self.writer
    }
}

impl std::ops::DerefMut for WriterGuard<'_> {
    fn deref_mut(&mut self) -> &mut StoreWriter {
        &mut self.writer
    }
}

impl StoreWriter {
    /// Whether `keys` holds a key twice (see [`has_repeats`]).
    fn has_repeats(&mut self, keys: &[u64]) -> bool {
        has_repeats(keys, &mut self.seen, self.seed)
    }

    /// After a removal's [`RunStore::cut`] of `keys`: whether two of its stretches name one
    /// block. Only blocks the store holds can be removed twice, and two stretches name one
    /// exactly when they are in one run and their offset ranges meet (a stretch's offsets are
    /// consecutive, a run's keys distinct), so this is exact for a removal. Many stretches are
    /// checked through [`has_repeats`] instead of pairwise.
    fn blocks_repeat(&mut self, keys: &[u64]) -> bool {
        if self.stretches.len() < 2 {
            return false; // one stretch names each of its blocks once
        }
        let mut ranges = [(0usize, 0usize, 0usize); 16];
        let mut n = 0;
        for s in &self.stretches {
            let Stretch::InRun { from, to, run, .. } = *s else {
                continue;
            };
            let offset = |i: usize| unpack(self.values[i].unwrap_or_default()).1;
            let (a, b) = (offset(from), offset(to - 1));
            let range = (run.as_ptr() as usize, a.min(b), a.max(b));
            if n == ranges.len() {
                return self.has_repeats(keys);
            }
            let meets = ranges[..n]
                .iter()
                .any(|&(r, lo, hi)| r == range.0 && lo <= range.2 && range.1 <= hi);
            if meets {
                return true;
            }
            ranges[n] = range;
            n += 1;
        }
        false
    }

    fn next_generation(&mut self) -> u32 {
        self.generation = self.generation.wrapping_add(1) & GEN_MASK;
        self.generation
    }
}

/// A stretch of a chain (see the module docs, "Writes").
#[derive(Clone, Copy)]
enum Stretch {
    Absent {
        from: usize,
        to: usize,
    },
    InRun {
        from: usize,
        to: usize,
        run: NonNull<BlockRun>,
        /// The keys name decreasing offsets (a chain given tail to head).
        descending: bool,
    },
    /// A key whose digest another key holds (a digest collision of keys of other lengths than
    /// 8): nothing can be written for it, and it holds nothing to remove.
    Taken,
}

fn slot(value: u64) -> SlotValue {
    // A run pointer is never null, so neither is a value naming it.
    SlotValue::new(value).unwrap_or(SlotValue::MIN)
}

fn run_ref<'g>(run: NonNull<BlockRun>) -> &'g BlockRun {
    // SAFETY: every run the store hands out here is named by a slot, a root slot or a checked
    // hint read under the caller's guard, or held by the writer, which alone retires runs.
    unsafe { run.as_ref() }
}

/// Whether `run` keeps too many dead offsets for its live ones (module docs, "Trimming").
fn is_sparse(run: &BlockRun) -> bool {
    run.len() >= TRIM_RATIO && run.refs() as usize * TRIM_RATIO <= run.len()
}

/// Bits of the filter [`has_repeats`] tries first (a power of two; 2 KiB on the stack).
const REPEAT_FILTER_BITS: usize = 1 << 14;

/// Whether `keys` holds a key twice: pairwise for a short chain, else through `seen`, an
/// open-addressed set of at least twice the chain's length (scratch reused between writes)
/// placed by `seed`, so a caller cannot choose keys that share a probe sequence. Linear in the
/// chain's length: every write runs it.
///
/// Most chains repeat nothing, and the set's probe loop, one unpredictable branch per key,
/// cost a chain ingest more than a tenth of its time. So a chain of up to 128 keys first sets
/// one bit per key in a filter, branch-free: if no two keys share a bit, no key repeats (the
/// answer is exact); only the rest (for 64 random keys, two share a bit about one time in
/// nine) go on to the set.
fn has_repeats(keys: &[u64], seen: &mut Vec<u64>, seed: u64) -> bool {
    if keys.len() <= 16 {
        return keys
            .iter()
            .enumerate()
            .any(|(i, k)| keys[i + 1..].contains(k));
    }
    if keys.len() <= 128 {
        let mut filter = [0u64; REPEAT_FILTER_BITS / 64];
        let mut shared = 0;
        for &key in keys {
            let bit = home(seed, 64 - REPEAT_FILTER_BITS.trailing_zeros(), key);
            let word = &mut filter[bit / 64];
            shared |= *word >> (bit % 64);
            *word |= 1 << (bit % 64);
        }
        if shared & 1 == 0 {
            return false;
        }
    }
    let len = (keys.len() * 2).next_power_of_two();
    let shift = 64 - len.trailing_zeros();
    seen.clear();
    seen.resize(len, 0);
    // Key 0 marks an empty entry, so it is tracked on its own.
    let mut zero = false;
    for &key in keys {
        if key == 0 {
            if zero {
                return true;
            }
            zero = true;
            continue;
        }
        let mut i = home(seed, shift, key);
        loop {
            match seen[i] {
                0 => {
                    seen[i] = key;
                    break;
                }
                k if k == key => return true,
                _ => i = (i + 1) & (len - 1),
            }
        }
    }
    false
}

impl Default for RunStore {
    fn default() -> Self {
        Self::new(StoreOptions::default())
    }
}

impl RunStore {
    /// An empty store whose slot tables and scratch are seeded per process.
    pub fn new(options: StoreOptions) -> Self {
        Self::with_tables(options, SlotTable::new(), SlotTable::new(), random_seed())
    }

    /// An empty store with fixed seeds (tests and models).
    pub fn with_seed(options: StoreOptions, seed: u64) -> Self {
        Self::with_tables(
            options,
            SlotTable::with_seed(seed),
            SlotTable::with_seed(seed ^ 1),
            seed ^ 2,
        )
    }

    fn with_tables(options: StoreOptions, table: SlotTable, roots: SlotTable, seed: u64) -> Self {
        Self {
            table,
            roots,
            ids: RunIds::new(),
            writer: Mutex::new(StoreState {
                seed,
                ..StoreState::default()
            }),
            run_bytes: AtomicU64::new(0),
            reaper: Arc::new(Reaper::default()),
            options,
        }
    }

    /// Keys present.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// No key present.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Root slots held (keys some ingest began with).
    pub fn root_count(&self) -> usize {
        self.roots.len()
    }

    /// Bytes of the slot tables, the live runs and the run ids.
    pub fn memory_bytes(&self, guard: &Guard) -> usize {
        self.table.memory_bytes(guard)
            + self.roots.memory_bytes(guard)
            + self.run_bytes.load(Ordering::Relaxed) as usize
            + self.ids.bytes()
    }

    /// [`RunStore::memory_bytes`] by part: the slot tables, the live runs, the run ids.
    pub fn memory_parts(&self, guard: &Guard) -> (usize, usize, usize) {
        (
            self.table.memory_bytes(guard) + self.roots.memory_bytes(guard),
            self.run_bytes.load(Ordering::Relaxed) as usize,
            self.ids.bytes(),
        )
    }

    /// Bytes of the live runs alone.
    pub fn run_bytes(&self) -> usize {
        self.run_bytes.load(Ordering::Relaxed) as usize
    }

    /// The live holders of the 8-byte key `key`, if present, each with its entry's token count.
    pub fn holders(&self, key: u64, guard: &Guard) -> Option<Vec<Holder>> {
        self.holders_keyed(key, None, guard)
    }

    /// The live holders of the key with `digest` and long part `long` ([`long_part`]), if
    /// present, each with its entry's token count ([`BlockRun::tokens_at`]).
    pub fn holders_keyed(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        guard: &Guard,
    ) -> Option<Vec<Holder>> {
        let mut out = Vec::new();
        self.for_each_holder_keyed(digest, long, guard, |h| out.push(h))
            .then_some(out)
    }

    /// Calls `f` with each live holder of the key with `digest` and long part `long`, with its
    /// entry's token count; false when the key is absent. Allocates nothing.
    pub fn for_each_holder_keyed(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        guard: &Guard,
        mut f: impl FnMut(Holder),
    ) -> bool {
        let Some((_, run, o)) = self.find_key(digest, long, guard) else {
            return false;
        };
        run.for_each_holder(|_, h| f(h.with_tokens(run.tokens_at(&h, o))));
        true
    }

    /// The slot value of the key with `digest` and long part `long`, with the run and offset
    /// it names; `None` when the key is absent (its digest's slot, if any, is another key's).
    fn find_key<'g>(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        guard: &'g Guard,
    ) -> Option<(u64, &'g BlockRun, usize)> {
        let value = self.table.find(digest, guard)?.get();
        Self::keyed(value, digest, long)
    }

    /// [`RunStore::find_key`] for a key expected present (a victim's), past the key table's
    /// summary word ([`SlotTable::find_present`]).
    fn find_victim<'g>(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        guard: &'g Guard,
    ) -> Option<(u64, &'g BlockRun, usize)> {
        let value = self.table.find_present(digest, guard)?.get();
        Self::keyed(value, digest, long)
    }

    /// The run and offset a slot value names, if that block's key is `digest` with long part
    /// `long`.
    fn keyed<'g>(
        value: u64,
        digest: u64,
        long: Option<&[u8]>,
    ) -> Option<(u64, &'g BlockRun, usize)> {
        let (run, o) = unpack(value);
        let run = run_ref(run);
        run.is_key(o, digest, long).then_some((value, run, o))
    }

    /// Walks the longest prefix of `request` present in the store: calls `visit(run, from, to)`
    /// for each stretch `request[from..to]` whose blocks `run`'s live holders hold, in request
    /// order, until a block is absent or `visit` returns false. Returns the blocks visited.
    pub fn walk<'k, K: AsRef<[u8]> + 'k>(
        &self,
        request: impl Into<Keys<'k, K>>,
        guard: &Guard,
        visit: impl FnMut(&BlockRun, usize, usize) -> bool,
    ) -> usize {
        let keys: Keys<'k, K> = request.into();
        match keys.digests.first() {
            Some(&first) => match self.first_block(first, guard) {
                Some(value) => self.walk_from(value, keys, guard, visit),
                None => 0,
            },
            None => 0,
        }
    }

    /// The slot value of the key with digest `digest` as a walk's block 0 finds it (the key table's
    /// summary word, the root slots, then the key table), if some key has that digest: a caller can
    /// rule out a walk whose block 0 is absent before it prepares the rest of its request
    /// ([`RunStore::walk_from`]).
    #[inline]
    pub fn first_block(&self, digest: u64, guard: &Guard) -> Option<u64> {
        if !self.options.roots {
            return self.table.find(digest, guard).map(SlotValue::get);
        }
        // The key table's summary word first: every root is a key of the key table too, so a
        // key the word rules out is in neither table, and most absent keys (a request for a
        // novel prefix) stop there, at one load, without the root table's probe. A present
        // key then usually finds its value in the root table, whose lines stay cached, rather
        // than in the key table's slot line.
        let probe = self.table.probe(digest, guard)?;
        if !probe.may_contain() {
            return None;
        }
        if let Some(root) = self.roots.find(digest, guard) {
            return Some(root.get());
        }
        probe.find().map(SlotValue::get)
    }

    /// [`RunStore::walk`] from block 0's slot value `value`, as [`RunStore::first_block`]
    /// found it for `request`'s first key.
    pub fn walk_from(
        &self,
        mut value: u64,
        keys: impl Request,
        guard: &Guard,
        mut visit: impl FnMut(&BlockRun, usize, usize) -> bool,
    ) -> usize {
        let len = keys.len();
        let mut pos = 0;
        // Whether `value`'s lines are fetched already (a hint's were, when it was read).
        let mut fetched = false;
        // A key placed in the key table when its lines were prefetched, with its position in
        // the request: the find at that position (where a walk usually stops) reuses it.
        let mut placed: Option<(usize, Option<Probe<'_>>)> = None;
        loop {
            let (run, o) = unpack(value);
            if !fetched {
                BlockRun::prefetch(run.as_ptr(), o);
            }
            let run = run_ref(run);
            // The slot or hint matched the digest; a key of another length (the request's or
            // the run's) must match its bytes too.
            let long = keys.long(pos);
            if (long.is_some() || run.is_long()) && run.long_key(o) != long {
                return pos;
            }
            let max = (run.live_end(o) - o - 1).min(len - pos - 1);
            let landing = pos + 1 + max;
            // The next block if the request follows the stretch to its end: its hint is read
            // now and its run's lines fetched, so they come in while the keys are compared; the
            // hint is checked (which reads that run) only after the compare.
            let mut ahead = None;
            if landing < len {
                let k = keys.digest(landing);
                match self.options.hints.then(|| run.peek_hint(k)).flatten() {
                    Some(hinted) => {
                        hinted.prefetch(&self.ids);
                        // The landing after the hinted stretch, if the request follows it too:
                        // the summary word that settles an absent key there (the usual reason
                        // a walk stops) arrives with the hinted run instead of after it.
                        let after = landing + hinted.span();
                        if after < len {
                            let probe = self.table.probe(keys.digest(after), guard);
                            if let Some(probe) = &probe {
                                probe.prefetch_summary();
                            }
                            placed = Some((after, probe));
                        }
                        ahead = Some(hinted);
                    }
                    None => {
                        // A block no hint names is most often absent (a run's hints name the
                        // runs that follow it): its summary word settles that, so only that
                        // word is fetched. Fetching its slot lines too cost a Q50 walk, which
                        // stops there, a tenth of its time in memory traffic it never used.
                        let probe = self.table.probe(k, guard);
                        if let Some(probe) = &probe {
                            probe.prefetch_summary();
                        }
                        placed = Some((landing, probe));
                    }
                }
            }
            let run_keys = &run.keys()[o + 1..o + 1 + max];
            let mut m = keys.leading_digests(pos + 1, run_keys);
            if run.is_long() || keys.any_long() {
                m = (0..m)
                    .take_while(|&j| key_is_at(&keys, pos + 1 + j, run, o + 1 + j))
                    .count();
            }
            let to = pos + 1 + m;
            if !visit(run, pos, to) || to == len {
                return to;
            }
            pos = to;
            let hinted = ahead
                .filter(|_| m == max)
                .and_then(|h| h.check(&self.ids, guard));
            fetched = hinted.is_some();
            let next = hinted.or_else(|| {
                let probe = match placed {
                    Some((at, probe)) if at == pos => probe,
                    _ => self.table.probe(keys.digest(pos), guard),
                };
                probe.and_then(|probe| probe.find()).map(SlotValue::get)
            });
            match next {
                Some(v) => value = v,
                None => return pos,
            }
        }
    }

    /// Cuts `keys` into stretches (module docs, "Writes"). With `counts` (an ingest: the
    /// blocks' own token counts), a stretch also ends where its run's token step would break
    /// (`block_run`, "Token counts"): after its first block, every block's count is the step
    /// (an absent stretch's is its second block's count), and it follows its run forwards
    /// only. Fills `w.values` and `w.stretches`.
    fn cut<K: AsRef<[u8]>>(
        &self,
        w: &mut StoreWriter,
        chain: Keys<'_, K>,
        counts: Option<&[i32]>,
        guard: &Guard,
    ) {
        let keys = chain.digests;
        let StoreWriter {
            values, stretches, ..
        } = w;
        values.clear();
        stretches.clear();
        // Whether block `i` may continue the absent stretch that began at `from`.
        let steady =
            |i: usize, from: usize| i == from + 1 || counts.is_none_or(|c| c[i] == c[from + 1]);
        let mut fetched = 0;
        let mut i = 0;
        // The probe of `keys[i]` when an absent stretch's loop made it already.
        let mut carried = None;
        while i < keys.len() {
            let found = carried
                .take()
                .unwrap_or_else(|| self.table.find(keys[i], guard).map(SlotValue::get));
            let Some(v) = found else {
                let from = i;
                loop {
                    values.push(None);
                    i += 1;
                    let ahead = (i + AHEAD).min(keys.len());
                    for k in &keys[fetched.max(i)..ahead] {
                        self.table.prefetch(*k, guard);
                    }
                    fetched = fetched.max(ahead);
                    if i == keys.len() || i - from == MAX_LEN {
                        break;
                    }
                    if let Some(v) = self.table.find(keys[i], guard) {
                        carried = Some(Some(v.get()));
                        break;
                    }
                    if !steady(i, from) {
                        carried = Some(None);
                        break;
                    }
                }
                stretches.push(Stretch::Absent { from, to: i });
                continue;
            };
            let (run, o) = unpack(v);
            let r = run_ref(run);
            let from = i;
            if !key_is_at(&chain, i, r, o) {
                values.push(None);
                stretches.push(Stretch::Taken);
                i += 1;
                continue;
            }
            values.push(Some(pack(run, o)));
            i += 1;
            let run_keys = r.keys();
            let live = |p: usize| p < run_keys.len() && !r.is_dead(p);
            // Digests first; long parts only where a key has one.
            let compare_bytes = chain.bytes.is_some() || r.is_long();
            let same = |i: usize, p: usize| {
                run_keys[p] == keys[i] && (!compare_bytes || key_is_at(&chain, i, r, p))
            };
            let step = r.step();
            let descending = counts.is_none()
                && i < keys.len()
                && o > 0
                && live(o - 1)
                && same(i, o - 1)
                && !(live(o + 1) && same(i, o + 1));
            while i < keys.len() && counts.is_none_or(|c| c[i] == step) {
                let step = i - from;
                let p = if descending {
                    match o.checked_sub(step) {
                        Some(p) => p,
                        None => break,
                    }
                } else {
                    o + step
                };
                if !live(p) || !same(i, p) {
                    break;
                }
                values.push(Some(pack(run, p)));
                i += 1;
            }
            // A removal's stretch of a run with one holder will most likely lose its slots:
            // their home lines are fetched now, while the rest of the chain is cut (the keys
            // are present: no summary word is read for them).
            if counts.is_none() && r.holder_count() == 1 {
                for k in &keys[from..i.min(from + AHEAD)] {
                    self.table.prefetch_present(*k, guard);
                }
            }
            stretches.push(Stretch::InRun {
                from,
                to: i,
                run,
                descending,
            });
        }
    }

    fn holder_capacity(&self, n: usize) -> usize {
        if self.options.join {
            (n + 1).min(MAX_HOLDERS)
        } else {
            n
        }
    }

    /// Takes the writer lock and frees the retired runs waiting on the reaper.
    fn lock_writer(&self) -> WriterGuard<'_> {
        let w = WriterGuard::new(self.writer.lock());
        self.reaper.free_all();
        w
    }

    /// Frees the retired runs waiting on the reaper (every write does this when it takes the
    /// writer lock; a store that gets no more writes can be emptied by this, e.g. from a
    /// sweep). Returns how many.
    pub fn free_retired(&self) -> usize {
        let _w = self.writer.lock();
        self.reaper.free_all()
    }

    /// Rebuilds smaller the key-table segments (of the key table and of the roots) whose live
    /// keys have fallen below 1/8 of their slots, one segment per hold of the writer lock, and
    /// frees the retired runs waiting on the reaper. Removals leave shrinking to this
    /// (`raw/slots.rs`, "Structure"); the index's sweep calls it for every partition, so a
    /// store with no segment flagged underfilled and no run waiting takes no lock. Returns the
    /// segments rebuilt.
    pub fn shrink(&self, guard: &Guard) -> usize {
        let mut flagged = self.table.underfilled() | self.roots.underfilled();
        if flagged == 0 {
            if !self.reaper.is_empty() {
                self.free_retired();
            }
            return 0;
        }
        let mut rebuilt = 0;
        while flagged != 0 {
            let s = flagged.trailing_zeros() as usize;
            flagged &= flagged - 1;
            let _w = self.lock_writer();
            rebuilt += usize::from(self.table.lock().shrink(s, guard));
            rebuilt += usize::from(self.roots.lock().shrink(s, guard));
        }
        rebuilt
    }

    /// A new registered run over `keys` with token step `step`, counting the slots its caller
    /// points at it.
    fn new_run<K: AsRef<[u8]>>(
        &self,
        w: &mut StoreWriter,
        holders: &[Holder],
        keys: Keys<'_, K>,
        step: i32,
    ) -> Option<NonNull<BlockRun>> {
        let capacity = self.holder_capacity(holders.len());
        let run = BlockRun::create_keyed(holders, capacity, keys.digests, keys.bytes, step)?;
        if self.ids.register(&mut w.alloc, run).is_none() {
            // SAFETY: never registered, never in a slot.
            unsafe { BlockRun::discard(run) };
            return None;
        }
        let r = run_ref(run);
        r.add_refs(keys.len() as u64);
        self.run_bytes
            .fetch_add(r.bytes() as u64, Ordering::Relaxed);
        Some(run)
    }

    /// Drops `n` slot references of `run`; retires it with its last, or lists it for trimming
    /// if it became sparse.
    fn release(&self, w: &mut StoreWriter, run: NonNull<BlockRun>, n: u64, guard: &Guard) {
        let r = run_ref(run);
        if r.release(n) {
            self.run_bytes
                .fetch_sub(r.bytes() as u64, Ordering::Relaxed);
            // SAFETY: registered by `new_run`, no slot names it any more, released once.
            unsafe { BlockRun::retire(run, &self.ids, &mut w.alloc, &self.reaper, guard) };
        } else if is_sparse(r) {
            w.sparse.push(run);
        }
    }

    /// Copies each run listed sparse onto new runs over its live offsets (module docs,
    /// "Trimming"), one per stretch of consecutive live offsets (a copy keeps its tokens
    /// affine: `block_run`, "Token counts"); a run whose stretches would take more bytes as
    /// runs of their own than it does is left as it is. Runs at the end of a write, once no
    /// stretch of it names a run any more.
    fn trim(&self, w: &mut StoreWriter, guard: &Guard) {
        while let Some(run) = w.sparse.pop() {
            let r = run_ref(run);
            // A run retired since it was listed has no references (its memory waits for this
            // write's guard); one listed twice is no longer sparse after its first trim.
            if r.refs() == 0 || !is_sparse(r) {
                continue;
            }
            let mut ranges = Vec::new();
            let mut o = 0;
            while o < r.len() {
                if r.is_dead(o) {
                    o += 1;
                    continue;
                }
                let end = r.live_end(o);
                ranges.push(o..end);
                o = end;
            }
            let copies: usize = ranges.iter().map(|range| r.copy_bytes(range.len())).sum();
            if ranges.len() > 1 && copies >= r.bytes() {
                continue;
            }
            for range in ranges {
                self.copy_range(w, run, range, guard);
            }
        }
    }

    /// Copies the live offsets `range` of `run` onto a new run with its live holders (their
    /// tokens moved to the range's first offset) and its hints, and repoints their slots.
    fn copy_range(
        &self,
        w: &mut StoreWriter,
        run: NonNull<BlockRun>,
        range: std::ops::Range<usize>,
        guard: &Guard,
    ) {
        let r = run_ref(run);
        let mut keys = std::mem::take(&mut w.ordered);
        let mut values = std::mem::take(&mut w.ordered_values);
        let mut holders = std::mem::take(&mut w.holders);
        values.clear();
        holders.clear();
        let bytes = copy_keys(r, range.clone(), &mut keys);
        values.extend(range.clone().map(|o| Some(pack(run, o))));
        r.for_each_holder(|_, h| holders.push(h.with_tokens(r.tokens_at(&h, range.start))));
        let copied = Keys {
            digests: &keys,
            bytes: bytes.as_deref(),
        };
        if let Some(new) = self.new_run(w, &holders, copied, r.step()) {
            let n = run_ref(new);
            r.for_each_hint(|k, target| n.set_hint(k, target));
            self.repoint(w, &keys, &values, run, Some(new), guard);
        }
        w.ordered = keys;
        w.ordered_values = values;
        w.holders = holders;
    }

    /// Ingests `keys` for `writing`, with the blocks' own token counts `counts`: block `i`'s
    /// entry holds the chain's cumulative count `counts[0] + … + counts[i]` (wrapping; the
    /// index's K8), a chain that repeats a key leaving it with its last occurrence's.
    pub fn ingest<'k, K: AsRef<[u8]> + 'k>(
        &self,
        keys: impl Into<Keys<'k, K>>,
        counts: &[i32],
        writing: Writing,
        guard: &Guard,
    ) -> IngestReport {
        self.ingest_with(keys, counts, writing, guard, |_, _| {})
    }

    /// [`RunStore::ingest`], calling `added(i, holder)` for each block `keys[i]` the replica did
    /// not hold before, in chain order (the change events, N1), with the entry it got (its
    /// token count the block's). A chain that repeats a key reports each occurrence that added
    /// the replica. A key whose digest another key of the store holds (keys of other lengths
    /// than 8 whose digests collide) is left as it was and counted in
    /// [`IngestReport::dropped`].
    pub fn ingest_with<'k, K: AsRef<[u8]> + 'k>(
        &self,
        keys: impl Into<Keys<'k, K>>,
        counts: &[i32],
        writing: Writing,
        guard: &Guard,
        mut added: impl FnMut(usize, Holder),
    ) -> IngestReport {
        let keys: Keys<'k, K> = keys.into();
        let n = keys.len().min(counts.len());
        let (keys, counts) = (keys.range(0..n), &counts[..n]);
        let mut w = self.lock_writer();
        let mut report = IngestReport::default();
        let mut cumulative = std::mem::take(&mut w.cumulative);
        cumulative.clear();
        cumulative.extend(counts.iter().scan(0i32, |sum, &c| {
            *sum = sum.wrapping_add(c);
            Some(*sum)
        }));
        if w.has_repeats(keys.digests) {
            // Key by key, each a chain of one block holding its cumulative count.
            for i in 0..n {
                self.ingest_locked(
                    &mut w,
                    keys.range(i..i + 1),
                    &cumulative[i..=i],
                    &cumulative[i..=i],
                    writing,
                    guard,
                    &mut report,
                    &mut |_, h| added(i, h),
                );
            }
        } else {
            self.ingest_locked(
                &mut w,
                keys,
                counts,
                &cumulative,
                writing,
                guard,
                &mut report,
                &mut added,
            );
        }
        w.cumulative = cumulative;
        self.trim(&mut w, guard);
        report
    }

    /// The ingest of a chain without repeats: `counts` are its blocks' own token counts,
    /// `cumulative` their running sums (the entries' token counts).
    #[allow(clippy::too_many_arguments)]
    fn ingest_locked<K: AsRef<[u8]>>(
        &self,
        w: &mut StoreWriter,
        chain: Keys<'_, K>,
        counts: &[i32],
        cumulative: &[i32],
        writing: Writing,
        guard: &Guard,
        report: &mut IngestReport,
        added: &mut impl FnMut(usize, Holder),
    ) {
        let keys = chain.digests;
        if keys.is_empty() {
            return;
        }
        self.cut(w, chain, Some(counts), guard);
        w.owners.clear();
        let stretches = std::mem::take(&mut w.stretches);
        for &s in &stretches {
            match s {
                Stretch::Taken => report.dropped += 1,
                Stretch::Absent { from, to } => {
                    let me = Holder::new(
                        writing.rep,
                        writing.tier,
                        cumulative[from],
                        writing.ts_ms,
                        w.next_generation(),
                    );
                    let step = if to - from > 1 { counts[from + 1] } else { 0 };
                    let Some(run) = self.new_run(w, &[me], chain.range(from..to), step) else {
                        report.dropped += to - from;
                        continue;
                    };
                    for k in keys[from..to].iter().take(AHEAD) {
                        self.table.prefetch(*k, guard);
                    }
                    let mut slots = self.table.lock();
                    for (o, k) in keys[from..to].iter().enumerate() {
                        if let Some(n) = keys.get(from + o + AHEAD) {
                            self.table.prefetch(*n, guard);
                        }
                        slots.insert(*k, slot(pack(run, o)), guard);
                    }
                    drop(slots);
                    report.added += to - from;
                    report.new_keys += to - from;
                    (from..to).for_each(|i| added(i, me.with_tokens(cumulative[i])));
                    w.owners.push((run, to));
                }
                Stretch::InRun { from, to, run, .. } => {
                    let r = run_ref(run);
                    // The stretch names offsets `o_from..` forwards (an ingest's cut follows a
                    // run forwards only), so its entries' counts are `base + step · o`.
                    let (_, o_from) = unpack(w.values[from].unwrap_or_default());
                    let step = r.step();
                    let base = cumulative[from].wrapping_sub(step.wrapping_mul(o_from as i32));
                    let mut holders = std::mem::take(&mut w.holders);
                    holders.clear();
                    r.for_each_holder(|_, h| holders.push(h));
                    // What the stretch needs: nothing, or a new run with `holders`, which adds
                    // the replica's entry `joined` (else refreshes it).
                    let (copy, joined) = 'decide: {
                        match holders.iter().position(|h| h.rep() == writing.rep) {
                            Some(i) => {
                                let fresh = holders[i].refreshed(base, writing.tier, writing.ts_ms);
                                if fresh == holders[i] {
                                    break 'decide (false, None);
                                }
                                holders[i] = fresh;
                                (true, None)
                            }
                            None => {
                                let me = Holder::new(
                                    writing.rep,
                                    writing.tier,
                                    base,
                                    writing.ts_ms,
                                    w.next_generation(),
                                );
                                if to - from == r.live_count() && r.push_holder(me) {
                                    self.ids.lower_age(r.id(), me.last_seen_ms());
                                    report.added += to - from;
                                    (from..to)
                                        .for_each(|i| added(i, me.with_tokens(cumulative[i])));
                                    break 'decide (false, None);
                                }
                                if holders.len() == MAX_HOLDERS {
                                    report.dropped += to - from;
                                    break 'decide (false, None);
                                }
                                let at = holders.partition_point(|h| h.rep() < writing.rep);
                                holders.insert(at, me);
                                (true, Some(me))
                            }
                        }
                    };
                    let new = if copy {
                        // The copy's offset 0 is the stretch's first block.
                        for h in holders.iter_mut() {
                            *h = h.with_tokens(r.tokens_at(h, o_from));
                        }
                        self.new_run(w, &holders, chain.range(from..to), step)
                    } else {
                        None
                    };
                    w.holders = holders;
                    if !copy {
                        w.owners.push((run, to));
                        continue;
                    }
                    let Some(new) = new else {
                        report.dropped += to - from;
                        continue;
                    };
                    match joined {
                        Some(me) => {
                            report.added += to - from;
                            (from..to).for_each(|i| added(i, me.with_tokens(cumulative[i])));
                        }
                        None => report.refreshed += to - from,
                    }
                    let end = o_from + (to - from);
                    let n = run_ref(new);
                    if end == r.len() {
                        r.for_each_hint(|k, target| n.set_hint(k, target));
                    } else if !r.is_dead(end) {
                        n.set_hint(r.key(end), HintTarget::at(r, pack(run, end)));
                    }
                    let olds = std::mem::take(&mut w.values);
                    self.repoint(w, &keys[from..to], &olds[from..to], run, Some(new), guard);
                    w.values = olds;
                    w.owners.push((new, to));
                }
            }
        }
        w.stretches = stretches;
        // The chain's first key gets a root slot.
        if self.options.roots
            && let Some(v) = self.table.find(keys[0], guard)
            && v.get() & FLAG == 0
        {
            let flagged = slot(v.get() | FLAG);
            self.table.lock().insert(keys[0], flagged, guard);
            self.roots.lock().insert(keys[0], flagged, guard);
        }
        // Each stretch's run hints at the block after it, as the ingest left it.
        for pair in w.owners.windows(2) {
            let (run, to) = pair[0];
            if let Some(v) = self.table.find(keys[to], guard) {
                let target = run_ref(unpack(v.get()).0);
                run_ref(run).set_hint(keys[to], HintTarget::at(target, v.get()));
            }
        }
    }

    /// Points the slots of `keys` (offsets of `old`, as `olds` name them) at offsets `0..` of
    /// `new`, or removes them; marks each old offset dead before its slot changes (invariant 2)
    /// and releases them.
    fn repoint(
        &self,
        w: &mut StoreWriter,
        keys: &[u64],
        olds: &[Option<u64>],
        old: NonNull<BlockRun>,
        new: Option<NonNull<BlockRun>>,
        guard: &Guard,
    ) {
        for k in keys.iter().take(AHEAD) {
            self.table.prefetch_present(*k, guard);
        }
        let o_run = run_ref(old);
        let mut slots: SlotWriter<'_> = self.table.lock();
        for (o, (k, was)) in keys.iter().zip(olds).enumerate() {
            if let Some(n) = keys.get(o + AHEAD) {
                self.table.prefetch_present(*n, guard);
            }
            let (_, old_o) = unpack(was.unwrap_or_default());
            o_run.set_dead(old_o);
            let replaced = match new {
                Some(r) => slots.insert(*k, slot(pack(r, o)), guard),
                None => slots.remove(*k, guard),
            };
            if replaced.is_some_and(|v| v.get() & FLAG != 0) {
                let mut roots = self.roots.lock();
                match new {
                    Some(r) => {
                        let flagged = slot(pack(r, o) | FLAG);
                        slots.insert(*k, flagged, guard);
                        roots.insert(*k, flagged, guard);
                    }
                    None => {
                        roots.remove(*k, guard);
                    }
                }
            }
        }
        drop(slots);
        self.release(w, old, keys.len() as u64, guard);
    }

    /// Removes replica `rep` from `keys` (PREFIX_EVICTED).
    pub fn evict<'k, K: AsRef<[u8]> + 'k>(
        &self,
        keys: impl Into<Keys<'k, K>>,
        rep: u32,
        guard: &Guard,
    ) -> EvictReport {
        self.evict_with(keys, rep, guard, |_, _| {})
    }

    /// [`RunStore::evict`], calling `removed(i, holder)` for each block `keys[i]` the replica
    /// held, in chain order (the change events, N1), with the entry it removed.
    pub fn evict_with<'k, K: AsRef<[u8]> + 'k>(
        &self,
        keys: impl Into<Keys<'k, K>>,
        rep: u32,
        guard: &Guard,
        mut removed: impl FnMut(usize, Holder),
    ) -> EvictReport {
        let keys: Keys<'k, K> = keys.into();
        let mut w = self.lock_writer();
        let report = match self.evict_locked(&mut w, keys, rep, guard, &mut removed) {
            Some(report) => report,
            None => {
                let mut report = EvictReport::default();
                for i in 0..keys.len() {
                    let one = keys.range(i..i + 1);
                    let mut at = |_, h| removed(i, h);
                    report += self
                        .evict_locked(&mut w, one, rep, guard, &mut at)
                        .unwrap_or_default();
                }
                report
            }
        };
        self.trim(&mut w, guard);
        report
    }

    /// Removes replica `rep` from every key it holds (ALL_CLEARED).
    pub fn clear_replica(&self, rep: u32, guard: &Guard) -> EvictReport {
        self.remove_holders(|h| h.rep() == rep, guard)
    }

    /// Removes every holder `doomed` picks (the TTL sweep: the stale ones; ALL_CLEARED: one
    /// replica's) from every key it holds. Run by run: each replica a run holds that is picked
    /// leaves the run over its live offsets, one stretch.
    pub fn remove_holders(&self, doomed: impl Fn(&Holder) -> bool, guard: &Guard) -> EvictReport {
        self.remove_holders_with(doomed, guard, |_, _, _| {})
    }

    /// [`RunStore::remove_holders`], calling `removed(digest, long part, holder)` for each entry
    /// it removes. The key table is walked segment by segment in slices of [`SLICE`] slots, the
    /// writer lock taken per slice (other writers wait for one slice at most); a slice restarts
    /// its segment's walk when that segment was rebuilt since the last slice (its positions
    /// moved), so every key present throughout is visited.
    pub fn remove_holders_with(
        &self,
        doomed: impl Fn(&Holder) -> bool,
        guard: &Guard,
        mut removed: impl FnMut(u64, Option<&[u8]>, Holder),
    ) -> EvictReport {
        let mut report = EvictReport::default();
        let mut keys = Vec::new();
        for segment in 0..SlotTable::segments() {
            let (mut from, mut done) = (0, 0);
            let mut table = self.table.segment_id(segment, guard);
            loop {
                let mut w = self.lock_writer();
                if self.table.segment_id(segment, guard) != table {
                    table = self.table.segment_id(segment, guard);
                    (from, done) = (0, 0);
                }
                let len = self.table.segment_capacity(segment, guard);
                if done >= len {
                    break;
                }
                let count = SLICE.min(len - done);
                let mut runs = Vec::new();
                let mut listed = std::collections::HashSet::new();
                from = self
                    .table
                    .for_each_value_in(segment, from, count, guard, |v| {
                        let (run, _) = unpack(v);
                        if listed.insert(run) {
                            let mut picked = Vec::new();
                            run_ref(run).for_each_holder(|_, h| {
                                if doomed(&h) {
                                    picked.push(h.rep());
                                }
                            });
                            if !picked.is_empty() {
                                runs.push((run, picked));
                            }
                        }
                    });
                done += count;
                for (run, picked) in runs {
                    let r = run_ref(run);
                    report +=
                        self.evict_from_run(&mut w, r, &picked, &mut keys, guard, &mut removed);
                }
                self.trim(&mut w, guard);
            }
        }
        report
    }

    /// Removes `keys` with all their holders (a quota's victims).
    pub fn remove_keys<'k, K: AsRef<[u8]> + 'k>(
        &self,
        keys: impl Into<Keys<'k, K>>,
        guard: &Guard,
    ) -> EvictReport {
        self.remove_keys_with(keys, guard, |_, _, _| {})
    }

    /// [`RunStore::remove_keys`], calling `removed(digest, long part, holder)` for each entry it
    /// removes.
    pub fn remove_keys_with<'k, K: AsRef<[u8]> + 'k>(
        &self,
        keys: impl Into<Keys<'k, K>>,
        guard: &Guard,
        mut removed: impl FnMut(u64, Option<&[u8]>, Holder),
    ) -> EvictReport {
        let keys: Keys<'k, K> = keys.into();
        let mut w = self.lock_writer();
        let report = self.remove_keys_locked(&mut w, keys, guard, &mut removed);
        self.trim(&mut w, guard);
        report
    }

    fn remove_keys_locked<K: AsRef<[u8]>>(
        &self,
        w: &mut StoreWriter,
        keys: Keys<'_, K>,
        guard: &Guard,
        removed: &mut impl FnMut(u64, Option<&[u8]>, Holder),
    ) -> EvictReport {
        let mut report = EvictReport::default();
        for i in 0..keys.len() {
            let k = keys.digest(i);
            let Some((v, r, o)) = self.find_victim(k, keys.long(i), guard) else {
                continue;
            };
            r.for_each_holder(|_, h| {
                report.removed += 1;
                removed(k, keys.long(i), h.with_tokens(r.tokens_at(&h, o)));
            });
            report.keys_removed += 1;
            self.unlink_key(w, k, v, guard);
        }
        report
    }

    /// Takes the key with `digest`, whose slot holds `value`, out of the store: its offset
    /// dead, its slot and root slot gone, its run released.
    fn unlink_key(&self, w: &mut StoreWriter, digest: u64, value: u64, guard: &Guard) {
        let (run, o) = unpack(value);
        // Invariant 2: the offset is dead before its slot goes.
        run_ref(run).set_dead(o);
        self.table.lock().remove(digest, guard);
        if value & FLAG != 0 {
            self.roots.lock().remove(digest, guard);
        }
        self.release(w, run, 1, guard);
    }

    /// Calls `f(digest, run, offset)` for the present keys among `count` key-table slots from
    /// cursor `from` on, and returns the cursor after them (wrapping): a sampling scan spread
    /// over calls, as the cap's hand takes victims. One lap of the cursor over an unchanging
    /// store visits every key once.
    pub fn scan(
        &self,
        from: usize,
        count: usize,
        guard: &Guard,
        mut f: impl FnMut(u64, &BlockRun, usize),
    ) -> usize {
        self.table.for_each_value_from(from, count, guard, |v| {
            let (run, o) = unpack(v);
            let r = run_ref(run);
            f(r.key(o), r, o);
        })
    }

    /// Calls `f(digest, run, offset)` for the key in the key-table slot `random` picks, if the
    /// slot is live ([`SlotTable::sample`]); returns whether it was.
    pub fn sample(
        &self,
        random: u64,
        guard: &Guard,
        f: impl FnOnce(u64, &BlockRun, usize),
    ) -> bool {
        let Some(v) = self.table.sample(random, guard) else {
            return false;
        };
        let (run, o) = unpack(v);
        let r = run_ref(run);
        f(r.key(o), r, o);
        true
    }

    /// Calls `f` for the runs registered at positions `first..end` of the run registry
    /// (`0..`[`RunStore::run_scan_len`]), with the run when its holders may have a `last_seen`
    /// at or before `max_age` (ms), else with [`ScanStep::Young`] (the run not read), until `f`
    /// returns `false`: the walk for old entries of the cap and the quotas, one visit per run
    /// rather than per key. Returns where it stopped (after an old run, at a young one; `end`
    /// if `f` never stopped it). The runs are live while `guard` is pinned.
    pub fn scan_runs(
        &self,
        first: usize,
        end: usize,
        max_age: i64,
        guard: &Guard,
        f: impl FnMut(ScanStep<'_>) -> bool,
    ) -> usize {
        self.ids.scan(first, end, max_age, guard, f)
    }

    /// Positions of the run registry (a run scan's lap).
    pub fn run_scan_len(&self) -> usize {
        self.ids.scan_len()
    }

    /// Prefetches the slot lines of a key about to be removed (its key-table slot and, were it
    /// a chain's first key, its root slot): the cap fetches its next victim's while the ingest
    /// in between runs.
    #[inline]
    pub fn prefetch_removal(&self, digest: u64, guard: &Guard) {
        self.table.prefetch_present(digest, guard);
        self.roots.prefetch_present(digest, guard);
    }

    /// Slots of the key table (a scan's lap).
    pub fn scan_len(&self, guard: &Guard) -> usize {
        self.table.scan_len(guard)
    }

    /// Removes `rep` from every live block of the run that holds the key with `digest` and
    /// long part `long` (the cap's victim: one replica's copy of a stretch, all blocks of one
    /// age), calling `removed(digest, long part, holder)` for each entry it removes. Nothing
    /// when the key is absent or `rep` does not hold it.
    pub fn remove_run_holder_with(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        rep: u32,
        guard: &Guard,
        mut removed: impl FnMut(u64, Option<&[u8]>, Holder),
    ) -> EvictReport {
        let mut w = self.lock_writer();
        let Some((_, r, _)) = self.find_victim(digest, long, guard) else {
            return EvictReport::default();
        };
        let mut held = false;
        r.for_each_holder(|_, h| held |= h.rep() == rep);
        if !held {
            return EvictReport::default();
        }
        let report = self.evict_from_run(&mut w, r, &[rep], &mut Vec::new(), guard, &mut removed);
        self.trim(&mut w, guard);
        report
    }

    /// Removes each of `reps` from every live block of `r`, calling `removed(digest, long
    /// part, holder)` for each entry it removes; `digests` is scratch.
    fn evict_from_run(
        &self,
        w: &mut StoreWriter,
        r: &BlockRun,
        reps: &[u32],
        digests: &mut Vec<u64>,
        guard: &Guard,
        removed: &mut impl FnMut(u64, Option<&[u8]>, Holder),
    ) -> EvictReport {
        let bytes = copy_keys(r, (0..r.len()).filter(|&o| !r.is_dead(o)), digests);
        let live = Keys {
            digests,
            bytes: bytes.as_deref(),
        };
        let mut report = EvictReport::default();
        for &rep in reps {
            // A run's live keys are distinct: no repeat to rule out.
            let mut at = |i: usize, h| removed(live.digest(i), live.long(i), h);
            report += self
                .evict_locked(w, live, rep, guard, &mut at)
                .unwrap_or_default();
        }
        report
    }

    /// Replica `rep`'s entry of the key with `digest` and long part `long`, if present, with
    /// its token count (lock-free).
    pub fn entry(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        rep: u32,
        guard: &Guard,
    ) -> Option<Holder> {
        let (_, run, o) = self.find_key(digest, long, guard)?;
        let mut found = None;
        run.for_each_holder(|_, h| {
            if h.rep() == rep {
                found = Some(h.with_tokens(run.tokens_at(&h, o)));
            }
        });
        found
    }

    /// Calls `f` with replica `rep`'s entry of the key (as [`RunStore::entry`] finds it) while
    /// holding the writer lock, so no write changes the entry until `f` returns (an entry's
    /// first LFU credit creates its cell so: `raw/lfu.rs`).
    pub fn with_entry_locked<R>(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        rep: u32,
        guard: &Guard,
        f: impl FnOnce(Option<Holder>) -> R,
    ) -> R {
        let _w = self.lock_writer();
        f(self.entry(digest, long, rep, guard))
    }

    /// Removes replica `rep`'s entry of the key if it is present and `doomed` picks it (checked
    /// under the writer lock: a cap victim re-validated; it may read the entry's [`RunMates`]),
    /// calling `removed(holder)` before it goes. Returns what it removed.
    pub fn remove_entry_if(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        rep: u32,
        guard: &Guard,
        doomed: impl FnOnce(&Holder, RunMates<'_>) -> bool,
        mut removed: impl FnMut(Holder),
    ) -> EvictReport {
        let mut w = self.lock_writer();
        let Some((value, run, o)) = self.find_victim(digest, long, guard) else {
            return EvictReport::default();
        };
        let (mut found, mut holding) = (None, 0);
        run.for_each_holder(|_, h| {
            holding += 1;
            if h.rep() == rep {
                found = Some(h.with_tokens(run.tokens_at(&h, o)));
            }
        });
        let Some(entry) = found.filter(|h| doomed(h, RunMates { run, offset: o })) else {
            return EvictReport::default();
        };
        if holding == 1 {
            // The replica is the block's only holder: its entry goes with the key, as a key's
            // removal takes it (`remove_keys_locked`), with no stretch to cut or run to copy.
            removed(entry);
            self.unlink_key(&mut w, digest, value, guard);
            self.trim(&mut w, guard);
            return EvictReport {
                removed: 1,
                keys_removed: 1,
            };
        }
        let report = one_key(digest, long, |key| {
            self.evict_locked(&mut w, key, rep, guard, &mut |_, h| removed(h))
                .unwrap_or_default()
        });
        self.trim(&mut w, guard);
        report
    }

    /// Removes the key with `digest` and long part `long` with all its holders if it is
    /// present and `doomed` picks its holders (checked under the writer lock: a quota victim
    /// re-validated), calling `removed(holder)` for each before they go.
    pub fn remove_key_if(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        guard: &Guard,
        doomed: impl FnOnce(&[Holder]) -> bool,
        mut removed: impl FnMut(Holder),
    ) -> EvictReport {
        let mut w = self.lock_writer();
        let Some((_, run, o)) = self.find_victim(digest, long, guard) else {
            return EvictReport::default();
        };
        let mut holders = Vec::new();
        run.for_each_holder(|_, h| holders.push(h.with_tokens(run.tokens_at(&h, o))));
        if !doomed(&holders) {
            return EvictReport::default();
        }
        let report = one_key(digest, long, |key| {
            self.remove_keys_locked(&mut w, key, guard, &mut |_, _, h| removed(h))
        });
        self.trim(&mut w, guard);
        report
    }

    /// Calls `f(key, run, offset)` for every present key (dump, digest, snapshot). Writers
    /// running meanwhile may move keys past the visit.
    pub fn for_each_key(&self, guard: &Guard, mut f: impl FnMut(u64, &BlockRun, usize)) {
        self.table.for_each_value(guard, |v| {
            let (run, o) = unpack(v);
            let r = run_ref(run);
            f(r.key(o), r, o);
        });
    }

    /// Removes `rep` from `keys`; `None`, having changed nothing, when two of the chain's keys
    /// name one block (a repeated key the store holds: written key by key instead).
    fn evict_locked<K: AsRef<[u8]>>(
        &self,
        w: &mut StoreWriter,
        keys: Keys<'_, K>,
        rep: u32,
        guard: &Guard,
        removed_at: &mut impl FnMut(usize, Holder),
    ) -> Option<EvictReport> {
        self.cut(w, keys, None, guard);
        if w.blocks_repeat(keys.digests) {
            return None;
        }
        let mut removed = 0;
        let mut keys_removed = 0;
        let stretches = std::mem::take(&mut w.stretches);
        for &s in &stretches {
            let Stretch::InRun {
                from,
                to,
                run,
                descending,
            } = s
            else {
                continue;
            };
            let r = run_ref(run);
            let (mut at, mut holding) = (None, 0);
            r.for_each_holder(|i, h| {
                holding += 1;
                if h.rep() == rep {
                    at = Some((i, h));
                }
            });
            let Some((at, gone)) = at else {
                continue;
            };
            // The removed entry of chain block `i`, with its token count.
            let entry = |values: &[Option<u64>], i: usize| {
                let o = unpack(values[i].unwrap_or_default()).1;
                gone.with_tokens(r.tokens_at(&gone, o))
            };
            if holding > 1 && self.options.gone && to - from == r.live_count() {
                (from..to).for_each(|i| removed_at(i, entry(&w.values, i)));
                r.set_gone(at);
                removed += to - from;
                continue;
            }
            // The stretch's keys in old-offset order (the chain's, matched in `cut`; a long
            // run's with their bytes).
            let mut ordered = std::mem::take(&mut w.ordered);
            let mut ordered_values = std::mem::take(&mut w.ordered_values);
            ordered_values.clear();
            ordered_values.extend_from_slice(&w.values[from..to]);
            if descending {
                ordered_values.reverse();
            }
            let bytes = if r.is_long() {
                let offsets = ordered_values
                    .iter()
                    .map(|v| unpack(v.unwrap_or_default()).1);
                copy_keys(r, offsets, &mut ordered)
            } else {
                ordered.clear();
                ordered.extend_from_slice(&keys.digests[from..to]);
                if descending {
                    ordered.reverse();
                }
                None
            };
            // The copy's offset 0 is the stretch's first offset in the run (`block_run`,
            // "Token counts").
            let first = unpack(ordered_values[0].unwrap_or_default()).1;
            let mut holders = std::mem::take(&mut w.holders);
            holders.clear();
            r.for_each_holder(|_, h| {
                if h.rep() != rep {
                    holders.push(h.with_tokens(r.tokens_at(&h, first)));
                }
            });
            let new = if holders.is_empty() {
                None
            } else {
                let copied = Keys {
                    digests: &ordered,
                    bytes: bytes.as_deref(),
                };
                self.new_run(w, &holders, copied, r.step())
            };
            // Without a run for the others (none could be built), the stretch stays as it was.
            if new.is_some() || holders.is_empty() {
                (from..to).for_each(|i| removed_at(i, entry(&w.values, i)));
                self.repoint(w, &ordered, &ordered_values, run, new, guard);
                if new.is_none() {
                    keys_removed += to - from;
                }
                removed += to - from;
            }
            w.holders = holders;
            w.ordered = ordered;
            w.ordered_values = ordered_values;
        }
        w.stretches = stretches;
        Some(EvictReport {
            removed,
            keys_removed,
        })
    }
}

impl Drop for RunStore {
    fn drop(&mut self) {
        // Each live run's references are exactly the key table slots naming it: drop them slot
        // by slot and free each run with its last, in slot order (deterministic for a seeded
        // table, which loom needs). No pin: a store may be dropped by an epoch's deferred
        // function (its partition's last reference), where pinning again is not allowed.
        let RunStore {
            table,
            ids,
            writer,
            reaper,
            ..
        } = self;
        let w = writer.get_mut();
        reaper.free_all();
        // SAFETY: `&mut self`: no reader or writer is left, so nothing can free what the table
        // names while it is read.
        let guard = unsafe { crossbeam_epoch::unprotected() };
        let mut runs = Vec::new();
        table.for_each_value(guard, |v| runs.push(unpack(v).0));
        for run in runs {
            let r = run_ref(run);
            if r.release(1) {
                ids.deregister(&mut w.alloc, r.id());
                // SAFETY: the store is being dropped, so no reader can reach its runs, and this
                // was the run's last reference.
                unsafe { BlockRun::discard(run) };
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
