//! One partition's storage (`docs/engine.md`, "Storage: the run layout"): the key-inline slot
//! table naming `(run, offset)`, the [`BlockRun`]s the slots name, their ids, and the root
//! slots. `tests` below compare it with a plain map after random ingests and removals; the
//! design probe (`bench/src/bin/layout-probe.rs`) runs W1M on it without the index.
//!
//! # Writes
//!
//! A write takes the store's writer lock once, for the whole chain. What the store keeps
//! between writes behind that lock is small (`StoreState`: the run-id allocator and the entry
//! generation); the write's scratch vectors belong to the writing thread (a
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
//! that word), so its first line is usually cached. An ingest whose chain visibly continues a
//! prefix (its first block's token count, which carries the prefix's tokens by K8, is larger
//! than its second's: an engine storing the blocks after ones it already reported) gives its
//! first key no root: that key is no request's block 0, and such roots would fill the table
//! (on the Mooncake replay, every stored event's first block) and cost each such ingest and
//! each removal of its key a second table's write. Roots only speed walks up, so a root
//! missing for any other reason changes no answer.
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
    BlockRun, FLAG, HintTarget, MAX_HOLDERS, MAX_LEN, RunIds, ScanStep, pack, unpack,
};
use crate::raw::holder::{GEN_MASK, Holder};
use crate::raw::key::{KeyBytes, Keys, Request, one_key};
use crate::raw::reaper::Reaper;
use crate::raw::run_ids::IdAllocator;
use crate::raw::slots::{Probe, SlotTable, SlotValue, SlotWriter, home};
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
    /// Retired runs past their grace period; the writers free them (`raw/reaper.rs`). Shared
    /// by the stores of one index ([`RunStore::with_reaper`]): a writer frees every store's.
    reaper: Arc<Reaper<BlockRun>>,
    options: StoreOptions,
}

/// What a store keeps between its writes, behind its writer lock: the run-id allocator and the
/// entry generation. (The placement seed of [`has_repeats`] is derived from the key table's;
/// the runs a write leaves sparse are the writer's, trimmed before the write ends.)
#[derive(Default)]
struct StoreState {
    alloc: IdAllocator,
    generation: u32,
}

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
        self.sparse.clear();
    }
}

std::thread_local! {
    /// The thread's [`StoreWriter`] while it holds no writer lock (its scratch buffers; the
    /// store's fields are moved out). Boxed, so taking and returning it moves one pointer, not
    /// the ~300 bytes of vector headers, at every write. `take` leaves `None`, so a thread
    /// holding two writer locks at once (none does) gives the second write a fresh writer.
    static WRITER: std::cell::Cell<Option<Box<StoreWriter>>> = const { std::cell::Cell::new(None) };
}

/// A held writer lock: the store's [`StoreState`] moved into the thread's [`StoreWriter`];
/// dropping it (also while unwinding) moves the state back and the scratch, emptied, to the
/// thread.
struct WriterGuard<'a> {
    state: crate::sync::MutexGuard<'a, StoreState>,
    /// Taken once, in `drop`.
    writer: std::mem::ManuallyDrop<Box<StoreWriter>>,
}

impl<'a> WriterGuard<'a> {
    fn new(mut state: crate::sync::MutexGuard<'a, StoreState>, seed: u64) -> Self {
        // `try_with`: a thread whose locals are being destroyed writes with a fresh writer.
        let mut writer = WRITER
            .try_with(std::cell::Cell::take)
            .ok()
            .flatten()
            .unwrap_or_default();
        writer.alloc = std::mem::take(&mut state.alloc);
        writer.generation = state.generation;
        writer.seed = seed;
        Self {
            state,
            writer: std::mem::ManuallyDrop::new(writer),
        }
    }
}

impl Drop for WriterGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: `writer` is taken here, once, and the guard is not used after its drop.
        let mut writer = unsafe { std::mem::ManuallyDrop::take(&mut self.writer) };
        self.state.alloc = std::mem::take(&mut writer.alloc);
        self.state.generation = writer.generation;
        // Every write trims what it left sparse before it ends (a write that unwound may leave
        // runs listed: they stay as they are, untrimmed, and are not carried to another write).
        debug_assert!(
            writer.sparse.is_empty() || std::thread::panicking(),
            "a write trims its sparse runs before it ends"
        );
        writer.clear_scratch();
        // A thread whose locals are gone drops the buffers here instead.
        let _ = WRITER.try_with(|cell| cell.set(Some(writer)));
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
        Self::with_reaper(options, Arc::default())
    }

    /// An empty store with fixed seeds (tests and models).
    pub fn with_seed(options: StoreOptions, seed: u64) -> Self {
        Self::with_tables(
            options,
            SlotTable::with_seed(seed),
            SlotTable::with_seed(seed ^ 1),
            Arc::default(),
        )
    }

    /// An empty store, seeded per process, whose retired runs go to `reaper`, which other
    /// stores may share (an index's partitions: each writer frees what any of them retired,
    /// and a partition costs no reaper of its own).
    pub fn with_reaper(options: StoreOptions, reaper: Arc<Reaper<BlockRun>>) -> Self {
        Self::with_tables(options, SlotTable::new(), SlotTable::new(), reaper)
    }

    fn with_tables(
        options: StoreOptions,
        table: SlotTable,
        roots: SlotTable,
        reaper: Arc<Reaper<BlockRun>>,
    ) -> Self {
        Self {
            table,
            roots,
            ids: RunIds::new(),
            writer: Mutex::new(StoreState::default()),
            run_bytes: AtomicU64::new(0),
            reaper,
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

    fn holder_capacity(&self, n: usize) -> usize {
        if self.options.join {
            (n + 1).min(MAX_HOLDERS)
        } else {
            n
        }
    }

    /// Takes the writer lock and frees the retired runs waiting on the reaper.
    fn lock_writer(&self) -> WriterGuard<'_> {
        // The placement seed of `has_repeats`: the key table's (secret, per process), moved
        // off it (`seed ^ 2` with `with_seed`'s tables, as when the store kept its own).
        let w = WriterGuard::new(self.writer.lock(), self.table.seed() ^ 2);
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
    /// (`raw/slots/`, "Structure"); the index's sweep calls it for every partition, so a
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

mod read;
mod remove;
mod write;

#[cfg(all(test, not(loom)))]
mod tests;
