//! Key-inline slots: the key table of the run layout (`docs/perf-log.md`, "The run layout").
//!
//! A partition's run store (`run_store/`) keys its entries through two of these tables: the key
//! table, whose value for a key names the `(run, offset)` that holds it (`block_run::pack`), and
//! the small table of root slots (the keys chains begin with). A [`SlotTable`] keeps the key
//! itself (its 64-bit digest, `key.rs`) in the slot beside the value: a probe is settled in its
//! slot line, and a rebuild reads only the old slots. This table does not interpret values
//! beyond "non-zero". The writer side ([`SlotTable::lock`], [`SlotWriter`]) is `writer.rs`.
//!
//! # Structure
//!
//! A table starts as **one segment** for all its keys (the *single table*) and, when that
//! segment would grow past [`SINGLE_MAX_SLOTS`] slots, **splits** into 64 segments, picked by
//! the top 6 bits of the seeded, multiplied key, listed in a segment directory. A segment is a
//! power-of-two array of 16-byte slots `{key, value}`, probed linearly from the
//! key's home (the mixed key's next bits), and a **presence summary**: one 64-bit word per 8
//! slots in which every key present sets four bits chosen by its hash (a superset: bits are
//! cleared only by a rebuild), so most absent keys stop at one word, 1/16 the size of the slots
//! and usually cached. At the loads the table keeps (3/8 to 3/4) a word holds 3 to 6 keys, so an
//! absent key finds all its bits set well under 1% of the time (0.5% of random keys in a table
//! of 2^20 keys at load 1/2; 1.7% with two bits per key). Such a false positive reads the key's
//! slot line, most often from memory: on a table larger than the caches it cost a lookup of an
//! absent key more than all its other work together. A slot is
//!
//! - **live**: `value != 0`; `key` is its key;
//! - **vacated** (a tombstone): `value == 0`, `key != 0`; a probe goes on past it, an insert may
//!   take it. A removed key 0 leaves key 1 behind, so that it does not read as empty;
//! - **empty**: `value == 0`, `key == 0`; a probe stops there.
//!
//! A removal whose next slot is empty leaves its slot empty rather than vacated: no key can sit
//! past an empty slot on a probe sequence through it, so the chain ends there anyway. Writers
//! keep at most 3/4 of a segment's slots live or vacated (there is always an empty slot); a
//! segment that would pass it is rebuilt at twice its live keys, rounded up to a power of two
//! (load ≤ 1/2 afterwards). A removal never rebuilds: a burst of them (a PREFIX_EVICTED per
//! chain, ALL_CLEARED) would pay rebuild after rebuild in the writer lock, each copying the
//! survivors of a segment on its way down. A segment whose live keys have fallen below 1/8 of
//! its slots is rebuilt smaller by [`SlotWriter::shrink`], which the owner calls from its
//! periodic maintenance (the index's sweep). Removals free no slots, so between two calls a
//! table is never larger than it was at its peak, which its live keys bounded.
//!
//! Segments are what keep memory flat. Churn at a steady size still leaves tombstones (a
//! removal inside a cluster), so a table at the cap is rebuilt every few seconds; a rebuild
//! holds the old and the new copy until the epoch frees the old one. Rebuilt one segment at a
//! time, that transient is 1/64 of the table (and the writer is held 1/64 as long) rather than
//! a second whole table. A segment gets its table at its first insert; before, it reads as
//! empty, so a split partition pays only for the segments its keys use.
//!
//! The single table is what keeps a small table small: most partitions (a tenant's or model's
//! few chains) never pass 48 keys, and a directory (64 view words and 64 table pointers,
//! 1 KiB) for each of their two tables would outweigh everything else they hold. Before the
//! split the table is the **root** word (0, or the single table's view word) plus writer
//! counts, about 56 bytes, and the single table's block, which the root word owns (no boxed
//! record beside it: the word tells the block's address and size, and a replaced word's block
//! is freed through the epoch by a deferred function that rebuilds the table from the word);
//! the split allocates the directory, and the root then names it for
//! the table's life (a split is never undone: a table that once held 49 keys keeps its
//! directory, and its segments shrink as usual). Positions of a scan and segment numbers are
//! the directory's; before the split, segment 0 is the single table and the others have none.
//! A split moves keys between segments, as a concurrent rebuild moves them between slots: a
//! scan spread over calls across a split may visit a key twice or miss one that moved to a
//! segment it had passed (the callers' scans allow both, `RunStore::remove_holders_with` by
//! restarting a segment whose table changed).
//!
//! # Memory ordering
//!
//! Writers hold the table's writer lock ([`SlotTable::lock`]); readers take no lock.
//!
//! - Insert into an empty or vacated slot: the key's summary bits are stored, then the key
//!   (Relaxed), then the value (Release). Replace: one Release store of the value. Remove: the
//!   value becomes 0 (Release), then the key becomes 0 (empty) or stays (vacated; key 0 becomes
//!   1) with a Release store.
//! - A reader loads the key (Acquire), the value (Acquire) and the key again. It answers the
//!   value only if both key loads are the key it probes for. A value read is the store of some
//!   insert or replace of the slot; everything before that store is visible to the second key
//!   load, including the key the slot held when the value was stored. So if the slot was
//!   vacated and taken by another key between the reader's loads, the second load sees that
//!   key (or a later one) and the reader moves on; if both loads see the probed key, the value
//!   is one that key held, which is all C3 asks (per-entry atomicity). A value of 0 with key 0
//!   read after it (Acquire on the key pairs with the removal's Release) ends the probe.
//! - A reader that misses a summary bit, or meets an empty slot an insert is about to fill,
//!   answers as if it read before that insert. One that has seen anything the inserting
//!   writer published later sees the bits (they were stored before the value's Release).
//! - A reader loads the root (Acquire), then, once split, the key's segment's view word in the
//!   directory (Acquire): two loads before the slots, the first of a word in the table's own
//!   record. No lock and no retry: reads stay wait-free.
//! - A rebuild fills a new segment table with Relaxed stores and publishes it with a Release
//!   store of its view word (the root before the split, the directory's word after; a 0 word,
//!   before the first insert, reads as absent); the old table is never written again and is
//!   freed through the epoch, so a reader still on it reads a consistent older state.
//! - The split fills the directory's view words and their tables with Relaxed stores (nothing
//!   reaches the directory yet) and publishes it with one Release store of the root; the
//!   single table is retired through the epoch like a rebuilt one. A reader that loaded the
//!   old root reads the single table's consistent older state; one that loaded the new root
//!   sees the directory's words and every slot stored before it. The directory is freed only
//!   when the table is dropped, so its address stays valid for any reader of the table.
//! - A reader's probe is bounded by the segment's length, so it ends even on a table whose
//!   writers keep moving its empty slots.
//!
//! Loom model m13a checks a reader against the insert, replace, removal and reuse of its
//! slot; m13b against a growth rebuild; m13c against the first insert's publication of the
//! root; m13d the present-key probe and the sampling draw; m13e a reader against the split.

use crate::raw::pages::PageArray;
use crate::sync::{AtomicU64, Mutex, MutexGuard, Ordering};
use crossbeam_epoch::{Atomic, Guard, Owned, Shared};
use std::marker::PhantomData;
use std::num::NonZeroU64;
use std::ptr::NonNull;

/// A slot's value: never 0 (0 marks a slot without a key).
pub type SlotValue = NonZeroU64;

/// Slots of the smallest segment (a power of two). Four: a partition's tables mostly hold one
/// or two keys (a tenant's or model's chain and its root), and a 4-slot segment's block is
/// 128 bytes where an 8-slot one's was 144 (see [`Slots::new`]).
const MIN_SLOTS: usize = 4;
/// Slots per presence-summary word.
const SUMMARY_SLOTS: usize = 8;
/// Bits of the mixed key that pick a segment (its top bits).
const SEGMENT_BITS: u32 = 6;
/// Segments of a table.
const SEGMENTS: usize = 1 << SEGMENT_BITS;
/// Slots of the largest table a table without a directory keeps: a growth past it splits the
/// table into the directory's segments (module docs, "Structure").
const SINGLE_MAX_SLOTS: usize = 64;
/// Bytes of a replaced segment table from which its rebuild hands it to the epoch's collector
/// at once.
const FLUSH_MIN: usize = 256 * 1024;
/// Multiplier of the placement (Fibonacci hashing: the top bits of `key · φ⁻¹ · 2⁶⁴`).
const HOME_MIX: u64 = 0x9E37_79B9_7F4A_7C15;
/// Multiplier of the summary bits (independent of the placement's bits).
const SUMMARY_MIX: u64 = 0xC2B2_AE3D_27D4_EB4F;

/// Slots of a table rebuilt for `live` keys: load ≤ 1/2, a power of two, at least
/// [`MIN_SLOTS`].
fn table_len(live: usize) -> usize {
    (live * 2).next_power_of_two().max(MIN_SLOTS)
}

/// Prefetches the cache line at `p` into all cache levels. A hint only: never faults.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` is a hint; it does not dereference `p` architecturally and never
    // faults, whatever the address. SSE is part of the x86_64 baseline.
    unsafe {
        core::arch::x86_64::_mm_prefetch(p as *const i8, core::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// A placement seed of its own for each caller (std's per-process random hasher keys), so
/// that a caller cannot choose keys that share a probe sequence.
pub(crate) fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    if let Some(seed) = crate::raw::hooks::FIXED_SEED {
        return seed;
    }
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    h.finish()
}

/// The seeded, multiplied key: its top bits place the key.
#[inline(always)]
fn mix(seed: u64, key: u64) -> u64 {
    (key ^ seed).wrapping_mul(HOME_MIX)
}

/// The home slot of `key` in an unsegmented table: the top `64 − shift` bits of the mixed key.
pub(crate) fn home(seed: u64, shift: u32, key: u64) -> usize {
    (mix(seed, key) >> shift) as usize
}

/// The segment of a mixed key: its top [`SEGMENT_BITS`] bits.
#[inline(always)]
fn segment_of(mixed: u64) -> usize {
    (mixed >> (64 - SEGMENT_BITS)) as usize
}

/// The presence-summary bits of `key`: four bits, each picked by 6 of the top 24 bits of the
/// multiplied key (the top bits of a product depend on every bit of the key, its low bits only
/// on the key's low bits). Two of the four may be the same bit, so a key sets 2 to 4.
#[inline(always)]
fn summary_bits(seed: u64, key: u64) -> u64 {
    let x = (key ^ seed).wrapping_mul(SUMMARY_MIX);
    1 << (x >> 58) | 1 << ((x >> 52) & 63) | 1 << ((x >> 46) & 63) | 1 << ((x >> 40) & 63)
}

#[repr(C, align(16))]
struct Slot {
    key: AtomicU64,
    value: AtomicU64,
}

/// One segment's table, owned: a block of `2^log2` slots followed by the presence summary, one
/// 64-bit word per [`SUMMARY_SLOTS`] slots (at least one), kept two to a trailing [`Slot`] (key,
/// then value field). One block, so that one word ([`SlotTable`]'s view of the segment) names
/// all of it.
///
/// The smallest table's block (4 slots and one summary slot, 80 bytes) is padded to 128 bytes,
/// a power of two: the block is 64-byte aligned (the view word keeps the log2 in the address's
/// low 6 bits), and mimalloc, the server's allocator, serves a 64-byte aligned block from its
/// size class only when the class's next free block happens to be aligned, which a
/// power-of-two class always is; otherwise it over-allocates by the alignment into a larger
/// class. Measured (`server/tests/allocator_classes.rs`, resident bytes per block): 80 bytes
/// aligned to 64 cost 157-168, 128 bytes cost 126; the 8-slot block (144 bytes) cost 210-231.
struct Slots {
    /// In page-granular blocks (`raw/pages.rs`): a table a rebuild replaces goes back to the
    /// system when freed, so RSS follows the tables' sizes under churn; and each 16-byte slot
    /// sits inside one cache line (the block is line-aligned).
    block: PageArray<Slot>,
    log2: u32,
}

impl Slots {
    /// Slots of the block of a table of `len` slots: the slots and the summary's.
    fn block_slots(len: usize) -> usize {
        let summary_slots = len.div_ceil(SUMMARY_SLOTS).div_ceil(2);
        if len == MIN_SLOTS {
            // 5 slots → 8 (128 bytes, a power of two: see the type's docs).
            (len + summary_slots).next_power_of_two()
        } else {
            len + summary_slots
        }
    }

    fn new(len: usize) -> Self {
        debug_assert!(len.is_power_of_two() && len >= MIN_SLOTS);
        let block_slots = Self::block_slots(len);
        // SAFETY: a slot is two `AtomicU64`s, and an `AtomicU64` of value 0 is all zero bytes.
        let block = unsafe {
            PageArray::zeroed(block_slots, || Slot {
                key: AtomicU64::new(0),
                value: AtomicU64::new(0),
            })
        };
        Slots {
            block,
            log2: len.trailing_zeros(),
        }
    }

    /// The word readers load to reach this table: the block's address (64-byte aligned, so
    /// its low 6 bits are free) with `log2` in them.
    fn view_word(&self) -> u64 {
        self.block.as_ptr() as u64 | u64::from(self.log2)
    }

    fn bytes(&self) -> usize {
        crate::raw::pages::heap_chunk(std::mem::size_of::<Slots>()) + self.block.footprint()
    }

    /// The table as its view word alone: the word owns the block from here on (the single
    /// table, which the root word names: no boxed record; [`Slots::from_word`] takes it back).
    fn into_word(self) -> u64 {
        let word = self.view_word();
        std::mem::forget(self);
        word
    }

    /// The table a word from [`Slots::into_word`] owns.
    ///
    /// # Safety
    /// `word` came from [`Slots::into_word`], and this is its one call for that word.
    unsafe fn from_word(word: u64) -> Slots {
        let log2 = (word & 63) as u32;
        let base = NonNull::new((word & !63) as *mut Slot).expect("a view word names a block");
        // SAFETY: the block of a table of `2^log2` slots, made by `PageArray::zeroed` with
        // `block_slots` slots and forgotten by `into_word` (caller).
        let block = unsafe { PageArray::from_raw(base, Self::block_slots(1 << log2)) };
        Slots { block, log2 }
    }

    /// Bytes of the table a word from [`Slots::into_word`] owns (its block: it has no record).
    fn word_bytes(word: u64) -> usize {
        let slots = Self::block_slots(1 << (word & 63));
        crate::raw::pages::footprint(slots * std::mem::size_of::<Slot>())
    }
}

/// A segment's table as readers reach it, from its view word: the slot block's address and
/// the log2 of its slot count. Valid for `'g`, a pinned guard's life: a table a rebuild
/// replaced is freed only through the epoch.
#[derive(Clone, Copy)]
struct View<'g> {
    base: NonNull<Slot>,
    log2: u32,
    _table: PhantomData<&'g Slot>,
}

impl<'g> View<'g> {
    /// The view a word names: `None` for 0 (a segment before its first insert).
    #[inline(always)]
    fn of(word: u64) -> Option<View<'g>> {
        NonNull::new((word & !63) as *mut Slot).map(|base| View {
            base,
            log2: (word & 63) as u32,
            _table: PhantomData,
        })
    }

    #[inline(always)]
    fn len(self) -> usize {
        1 << self.log2
    }

    #[inline(always)]
    fn mask(self) -> usize {
        self.len() - 1
    }

    /// The home of a mixed key: its `log2` bits just below the segment's.
    #[inline(always)]
    fn home(self, mixed: u64) -> usize {
        ((mixed << SEGMENT_BITS) >> (64 - self.log2)) as usize
    }

    /// Slot `i` (`i & mask`: always inside the table).
    #[inline(always)]
    fn slot(self, i: usize) -> &'g Slot {
        // SAFETY: the block holds `len` slots then the summary (`Slots::new`), initialized and
        // alive for `'g` (the type's invariant); `i & mask < len`.
        unsafe { &*self.base.as_ptr().add(i & self.mask()) }
    }

    /// The summary word covering the home `home` (< len).
    #[inline(always)]
    fn summary_word(self, home: usize) -> &'g AtomicU64 {
        let word = (home & self.mask()) / SUMMARY_SLOTS;
        // SAFETY: the block holds at least `len.div_ceil(SUMMARY_SLOTS).div_ceil(2)` trailing
        // slots after the `len` table slots (`Slots::new`), and `word / 2` is below that count.
        let pair = unsafe { &*self.base.as_ptr().add(self.len() + word / 2) };
        if word.is_multiple_of(2) {
            &pair.key
        } else {
            &pair.value
        }
    }

    /// The value of `key` (mixed `mixed`, summary bits `bits`), if present (lock-free; see
    /// "Memory ordering").
    #[inline(always)]
    fn find(self, key: u64, mixed: u64, bits: u64) -> Option<SlotValue> {
        if self.summary_word(self.home(mixed)).load(Ordering::Relaxed) & bits != bits {
            return None;
        }
        self.find_in_slots(key, mixed)
    }

    /// [`View::find`] past the summary word: the probe over the slots from the key's home.
    #[inline(always)]
    fn find_in_slots(self, key: u64, mixed: u64) -> Option<SlotValue> {
        let home = self.home(mixed);
        // `slot` wraps the index: the probe runs once round the table at most.
        for i in home..home + self.len() {
            let slot = self.slot(i);
            let first = slot.key.load(Ordering::Acquire);
            let value = slot.value.load(Ordering::Acquire);
            if value == 0 {
                if first == 0 {
                    return None;
                }
            } else if first == key && slot.key.load(Ordering::Relaxed) == key {
                return NonZeroU64::new(value);
            }
        }
        None
    }

    /// Writer side: the index of the live slot holding `key`, and the first vacated or empty
    /// slot of its probe sequence (where an insert of `key` goes).
    fn locate(self, key: u64, mixed: u64) -> (Option<usize>, usize) {
        let mask = self.mask();
        let mut i = self.home(mixed);
        let mut free = None;
        for _ in 0..self.len() {
            let slot = self.slot(i);
            let value = slot.value.load(Ordering::Relaxed);
            let k = slot.key.load(Ordering::Relaxed);
            if value != 0 && k == key {
                return (Some(i), i);
            }
            if value == 0 {
                let free_here = *free.get_or_insert(i);
                if k == 0 {
                    return (None, free_here);
                }
            }
            i = (i + 1) & mask;
        }
        // Unreachable while writers keep an empty slot; the first vacated one is still right.
        (None, free.unwrap_or(0))
    }

    /// Writer side: the first vacated or empty slot of `mixed`'s probe sequence, for a key the
    /// writer knows is absent (its probe need not go on to an empty slot to prove it).
    fn locate_free(self, mixed: u64) -> usize {
        let mask = self.mask();
        let mut i = self.home(mixed);
        for _ in 0..self.len() {
            if self.slot(i).value.load(Ordering::Relaxed) == 0 {
                return i;
            }
            i = (i + 1) & mask;
        }
        // Unreachable while writers keep an empty slot.
        0
    }

    /// Writer side: stores `key → value` into slot `i`, vacated or empty (summary bits, key,
    /// then the value that publishes it).
    fn fill(self, i: usize, key: u64, mixed: u64, bits: u64, value: SlotValue) {
        let word = self.summary_word(self.home(mixed));
        word.store(word.load(Ordering::Relaxed) | bits, Ordering::Relaxed);
        let slot = self.slot(i);
        slot.key.store(key, Ordering::Relaxed);
        slot.value.store(value.get(), Ordering::Release);
    }

    /// Calls `f` with the value of every live slot among `count` slots from `from` on
    /// (wrapping), and returns the position after the last slot visited.
    fn for_each_value_from(self, from: usize, count: usize, f: &mut impl FnMut(u64)) -> usize {
        let mask = self.mask();
        let mut at = from & mask;
        for _ in 0..count.min(self.len()) {
            let v = self.slot(at).value.load(Ordering::Acquire);
            if v != 0 {
                f(v);
            }
            at = (at + 1) & mask;
        }
        at
    }
}

/// A lookup of one key in its segment's table, placed once ([`SlotTable::probe`]): its
/// summary word can be prefetched and the key found later without placing it again. Valid
/// for `'g`, like the table it reads.
#[derive(Clone, Copy)]
pub struct Probe<'g> {
    table: View<'g>,
    key: u64,
    mixed: u64,
    bits: u64,
}

impl Probe<'_> {
    /// Prefetches the summary word and the home slot line [`Probe::find`] reads.
    #[inline]
    pub fn prefetch(&self) {
        let home = self.table.home(self.mixed);
        prefetch(std::ptr::from_ref(self.table.slot(home)));
        // The next line too: at the loads writers keep, a probe often runs past its home line.
        prefetch(std::ptr::from_ref(self.table.slot((home | 3) + 1)));
        prefetch(std::ptr::from_ref(self.table.summary_word(home)));
    }

    /// Prefetches the summary word [`Probe::find`] reads first.
    #[inline]
    pub fn prefetch_summary(&self) {
        prefetch(std::ptr::from_ref(
            self.table.summary_word(self.table.home(self.mixed)),
        ));
    }

    /// Whether the key may be present: false when its presence-summary bits are not all set
    /// (the first step of [`Probe::find`], alone: one load).
    #[inline]
    pub fn may_contain(&self) -> bool {
        let word = self.table.summary_word(self.table.home(self.mixed));
        word.load(Ordering::Relaxed) & self.bits == self.bits
    }

    /// The key's value, if present (as [`SlotTable::find`], in the table placed when the
    /// probe was made: a rebuild since then is read as if the probe came before it).
    #[inline]
    pub fn find(&self) -> Option<SlotValue> {
        self.table.find(self.key, self.mixed, self.bits)
    }
}

/// One segment's writer-side counts (under the writer lock). 32 bits: a segment of 2^32 slots
/// would be 64 GiB, far past any partition the index holds.
#[derive(Clone, Copy, Default)]
struct SegmentCounts {
    /// Live slots.
    live: u32,
    /// Live and vacated slots.
    used: u32,
}

/// Writer-side state (under the writer lock).
struct Counts {
    /// The counts of the single table, before the table has a directory.
    single: SegmentCounts,
    /// Each segment's counts, from the split on (with the directory).
    segments: Option<Box<[SegmentCounts; SEGMENTS]>>,
}

impl Counts {
    fn of(&self, s: usize) -> SegmentCounts {
        match &self.segments {
            Some(segments) => segments[s],
            None => self.single,
        }
    }

    fn of_mut(&mut self, s: usize) -> &mut SegmentCounts {
        match &mut self.segments {
            Some(segments) => &mut segments[s],
            None => &mut self.single,
        }
    }
}

/// A table's segment directory, allocated when its single table splits and freed with the
/// table (never replaced, so a reader that loaded its address may use it while it holds the
/// table). 64-byte aligned: its address is told from a view word by its zero low 6 bits.
#[repr(C, align(64))]
struct Directory {
    /// Each segment's view word ([`Slots::view_word`]; 0 for a segment without keys yet): all
    /// a reader loads, after the root, to reach a segment's slots and summary.
    views: [AtomicU64; SEGMENTS],
    /// The tables the views name, owned here and retired through the epoch (null for a
    /// segment without a table). Writers only.
    tables: [Atomic<Slots>; SEGMENTS],
}

/// What a table's root word names (see [`SlotTable`]).
enum Root<'t> {
    /// No key was ever inserted.
    Empty,
    /// One table for all keys: its view word.
    Single(u64),
    /// The segment directory.
    Directory(&'t Directory),
}

/// A table of key-inline slots; see the module docs.
pub struct SlotTable {
    /// What readers load first: 0 before the first insert; the single table's view word
    /// ([`Slots::view_word`], low 6 bits ≥ 2: its slots' log2) until the split, which owns
    /// the table's block ([`Slots::into_word`]: the single table has no boxed record, 24 bytes
    /// of every small table; a replaced word's block is freed through the epoch); from then
    /// on the address of the [`Directory`] (low 6 bits 0), never changed again.
    root: AtomicU64,
    writer: Mutex<Counts>,
    /// Live keys of all segments: the writer's count (written by the writer-lock holder
    /// alone), read by readers of the size (Relaxed; exact once writers quiesce).
    live: AtomicU64,
    /// Segment rebuilds so far (written under the writer lock). Unit tests only: the growth
    /// assertions read it, and its 8 bytes in each of a partition's two tables would put the
    /// partition with its `Arc` header past mimalloc's 320-byte class (issue 42).
    #[cfg(test)]
    rebuilds: AtomicU64,
    /// Bit `s`: segment `s` may be underfilled ([`SlotWriter::shrink`] would rebuild it). Set
    /// by a removal that leaves it so, cleared by its shrink or a shrink that finds it refilled;
    /// written under the writer lock, read without it ([`SlotTable::underfilled`]).
    underfilled: AtomicU64,
    seed: u64,
}

impl Default for SlotTable {
    fn default() -> Self {
        Self::new()
    }
}

impl SlotTable {
    /// An empty table whose key placement is seeded per process, so a caller cannot choose
    /// keys that share a probe sequence.
    pub fn new() -> Self {
        Self::with_seed(random_seed())
    }

    /// An empty table with a fixed placement seed (tests and models).
    pub fn with_seed(seed: u64) -> Self {
        SlotTable {
            root: AtomicU64::new(0),
            writer: Mutex::new(Counts {
                single: SegmentCounts::default(),
                segments: None,
            }),
            live: AtomicU64::new(0),
            #[cfg(test)]
            rebuilds: AtomicU64::new(0),
            underfilled: AtomicU64::new(0),
            seed,
        }
    }

    /// What the root names now.
    #[inline(always)]
    fn root(&self) -> Root<'_> {
        // Acquire: pairs with the Release store that published the single table (after its
        // slots) or the directory (after its view words and their tables' slots).
        let word = self.root.load(Ordering::Acquire);
        if word & 63 != 0 {
            Root::Single(word)
        } else if word == 0 {
            Root::Empty
        } else {
            // SAFETY: a non-zero root with its low 6 bits clear is the address of the
            // directory a split published (Release, loaded above with Acquire, so its contents
            // are visible); it is freed only when the table is dropped, after `&self`.
            Root::Directory(unsafe { &*(word as *const Directory) })
        }
    }

    /// The view word of segment `s` (0 for none): the single table's for segment 0 before the
    /// split.
    #[inline(always)]
    fn segment_word(&self, s: usize) -> u64 {
        match self.root() {
            Root::Empty => 0,
            Root::Single(word) => {
                if s == 0 {
                    word
                } else {
                    0
                }
            }
            // Acquire: pairs with the Release store that published the segment's table.
            Root::Directory(directory) => directory.views[s].load(Ordering::Acquire),
        }
    }

    /// Segment `s`'s current table, if it has one, valid while `guard` is pinned. Before the
    /// split, the single table is segment 0 and the others have none.
    #[inline(always)]
    fn segment<'g>(&self, s: usize, _guard: &'g Guard) -> Option<View<'g>> {
        // The table stays allocated while `_guard` is pinned: a replaced one is retired
        // through the epoch after its view word changed.
        View::of(self.segment_word(s))
    }

    /// Every segment's current table (one root load), valid while `guard` is pinned.
    fn segment_views<'g>(&self, _guard: &'g Guard) -> [Option<View<'g>>; SEGMENTS] {
        match self.root() {
            Root::Empty => [None; SEGMENTS],
            Root::Single(word) => {
                std::array::from_fn(|s| if s == 0 { View::of(word) } else { None })
            }
            Root::Directory(directory) => {
                std::array::from_fn(|s| View::of(directory.views[s].load(Ordering::Acquire)))
            }
        }
    }

    /// The table of the mixed key `mixed`, if it has one, valid while `guard` is pinned: the
    /// single table before the split, its segment's after.
    #[inline(always)]
    fn table_of<'g>(&self, mixed: u64, _guard: &'g Guard) -> Option<View<'g>> {
        match self.root() {
            Root::Empty => None,
            Root::Single(word) => View::of(word),
            Root::Directory(directory) => {
                View::of(directory.views[segment_of(mixed)].load(Ordering::Acquire))
            }
        }
    }

    /// The value of `key`, if present (lock-free; see "Memory ordering").
    #[inline]
    pub fn find(&self, key: u64, guard: &Guard) -> Option<SlotValue> {
        let mixed = mix(self.seed, key);
        let bits = summary_bits(self.seed, key);
        self.table_of(mixed, guard)?.find(key, mixed, bits)
    }

    /// [`SlotTable::find`] for a key expected present (a victim about to be removed): the
    /// probe goes straight to the slots, without the summary word, which only settles absent
    /// keys and is most often not cached when the slot line was fetched ahead
    /// ([`SlotTable::prefetch_present`]). Same answer as `find`.
    pub fn find_present(&self, key: u64, guard: &Guard) -> Option<SlotValue> {
        let mixed = mix(self.seed, key);
        self.table_of(mixed, guard)?.find_in_slots(key, mixed)
    }

    /// Where a lookup of `key` goes, computed once for a prefetch now and a probe later
    /// ([`Probe`]); `None` when the key's segment has no table (the key is absent).
    #[inline]
    pub fn probe<'g>(&self, key: u64, guard: &'g Guard) -> Option<Probe<'g>> {
        let mixed = mix(self.seed, key);
        let table = self.table_of(mixed, guard)?;
        Some(Probe {
            table,
            key,
            mixed,
            bits: summary_bits(self.seed, key),
        })
    }

    /// Whether `key` may be present: false when its presence-summary bits are not all set
    /// (one load; the summary is a superset, so true proves nothing).
    #[inline]
    pub fn may_contain(&self, key: u64, guard: &Guard) -> bool {
        self.probe(key, guard)
            .is_some_and(|probe| probe.may_contain())
    }

    /// Prefetches the summary word and home slot line of `key` (a later [`SlotTable::find`]).
    #[inline]
    pub fn prefetch(&self, key: u64, guard: &Guard) {
        if let Some(probe) = self.probe(key, guard) {
            probe.prefetch();
        }
    }

    /// Prefetches the home slot line of a key known to be present (a writer's later replace or
    /// removal of it), and the next line when the home is its line's last slot: the summary
    /// word is not read for a present key, so not fetched either.
    #[inline]
    pub fn prefetch_present(&self, key: u64, guard: &Guard) {
        let mixed = mix(self.seed, key);
        let Some(table) = self.table_of(mixed, guard) else {
            return;
        };
        let home = table.home(mixed);
        prefetch(std::ptr::from_ref(table.slot(home)));
        if home & 3 == 3 {
            prefetch(std::ptr::from_ref(table.slot(home + 1)));
        }
    }

    /// Live keys (Relaxed: may lag a concurrent writer).
    pub fn len(&self) -> usize {
        self.live.load(Ordering::Relaxed) as usize
    }

    /// Whether the table holds no key (as [`SlotTable::len`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the current segment tables (slots, summaries, headers) and the directory.
    pub fn memory_bytes(&self, guard: &Guard) -> usize {
        let bytes = |table: &Atomic<Slots>| {
            let table = table.load(Ordering::Acquire, guard);
            // SAFETY: null or a table stored by a writer, freed only through the epoch, after
            // `guard`.
            unsafe { table.as_ref() }.map_or(0, Slots::bytes)
        };
        match self.root() {
            Root::Empty => 0,
            Root::Single(word) => Slots::word_bytes(word),
            Root::Directory(directory) => {
                crate::raw::pages::heap_chunk(std::mem::size_of::<Directory>())
                    + directory.tables.iter().map(bytes).sum::<usize>()
            }
        }
    }

    /// Calls `f` with the value of every live slot of the current tables (writers and owners:
    /// a concurrent writer may move values past the visit).
    pub fn for_each_value(&self, guard: &Guard, mut f: impl FnMut(u64)) {
        for table in self.segment_views(guard).into_iter().flatten() {
            table.for_each_value_from(0, table.len(), &mut f);
        }
    }

    /// Positions of a scan's lap: [`SlotTable::segments`] times the longest segment's length
    /// (0 while no segment has a table). Segment `s` owns the positions from `s` laps/64 on,
    /// and a position's offset in that range is a fraction of the segment's table, so a
    /// segment rebuilt at another size mid-lap is still covered where the lap stands, and a
    /// rebuild of one segment moves no other segment's positions.
    pub fn scan_len(&self, guard: &Guard) -> usize {
        let longest = self
            .segment_views(guard)
            .iter()
            .map(|t| t.map_or(0, View::len))
            .max()
            .unwrap_or(0);
        SEGMENTS * longest
    }

    /// Calls `f` with the value of every live slot among `count` positions from `from` on (of
    /// a lap of [`SlotTable::scan_len`] positions, wrapping at its end; a position past the
    /// end, from a lap the tables have since shrunk, is taken modulo the lap), and returns the
    /// position after the last one visited: a cursor for a scan spread over many calls (the
    /// cap's sampling hand). A position of a shorter segment than the longest covers a fraction
    /// of a slot, so not every position visits a slot; one lap over unchanging tables visits
    /// every slot once. A concurrent writer may move values past the visit, as in
    /// [`SlotTable::for_each_value`].
    pub fn for_each_value_from(
        &self,
        from: usize,
        count: usize,
        guard: &Guard,
        mut f: impl FnMut(u64),
    ) -> usize {
        let tables = self.segment_views(guard);
        let longest = tables
            .iter()
            .map(|t| t.map_or(0, View::len))
            .max()
            .unwrap_or(0);
        let lap = SEGMENTS * longest;
        if lap == 0 {
            return 0;
        }
        let mut left = count.min(lap);
        let mut at = from % lap;
        while left > 0 {
            let (s, offset) = (at / longest, at % longest);
            let n = left.min(longest - offset);
            if let Some(table) = tables[s] {
                // Both lengths are powers of two: the segment's slots are the positions
                // scaled down by their ratio.
                let scale = (longest / table.len()).trailing_zeros();
                let (first, end) = (offset >> scale, (offset + n) >> scale);
                table.for_each_value_from(first, end - first, &mut f);
            }
            left -= n;
            at = (at + n) % lap;
        }
        at
    }

    /// The value of one slot picked by `random`, if that slot is live: the segment by the top
    /// bits of `random`, the slot of its current table by the next ones. Over uniform
    /// `random`, every segment is picked alike and every slot of its table alike, as a
    /// position drawn over [`SlotTable::scan_len`] would pick them, but a draw reads one
    /// segment's view word instead of all of them (the cap's sampling).
    pub fn sample(&self, random: u64, guard: &Guard) -> Option<u64> {
        let table = self.table_of(random, guard)?;
        let v = table.slot(table.home(random)).value.load(Ordering::Acquire);
        NonZeroU64::new(v).map(NonZeroU64::get)
    }

    /// Segments of every table (a power of two).
    pub const fn segments() -> usize {
        SEGMENTS
    }

    /// Slot count of segment `s`'s current table (0 before its first insert).
    pub fn segment_capacity(&self, s: usize, guard: &Guard) -> usize {
        self.segment(s, guard).map_or(0, View::len)
    }

    /// Which table segment `s` has: equal answers under one pinned guard mean no rebuild
    /// replaced it between them (a replaced table is not freed, so its address not reused,
    /// while the guard is pinned).
    pub fn segment_id(&self, s: usize, _guard: &Guard) -> u64 {
        self.segment_word(s)
    }

    /// Calls `f` with the value of every live slot among `count` slots of segment `s` from
    /// position `from` on (wrapping at the segment's end), and returns the position after the
    /// last slot visited.
    pub fn for_each_value_in(
        &self,
        s: usize,
        from: usize,
        count: usize,
        guard: &Guard,
        mut f: impl FnMut(u64),
    ) -> usize {
        self.segment(s, guard)
            .map_or(0, |t| t.for_each_value_from(from, count, &mut f))
    }

    /// Slots of all current segment tables (tests and models).
    pub fn capacity(&self, guard: &Guard) -> usize {
        self.segment_views(guard)
            .iter()
            .map(|t| t.map_or(0, View::len))
            .sum()
    }

    /// Whether the table has split into its directory's segments (tests and models).
    pub fn is_split(&self) -> bool {
        matches!(self.root(), Root::Directory(_))
    }

    /// The segments that may be underfilled (bit `s` for segment `s`), read without the writer
    /// lock: 0 means no [`SlotWriter::shrink`] would rebuild anything, so a periodic caller can
    /// skip the lock. A removal after this read may leave another segment underfilled.
    pub fn underfilled(&self) -> u64 {
        self.underfilled.load(Ordering::Relaxed)
    }

    /// The table's placement seed (a store derives its other seeds from it).
    pub(crate) fn seed(&self) -> u64 {
        self.seed
    }

    /// Segment rebuilds so far (the growth, shrinking and tombstone clearing of segments).
    #[cfg(test)]
    pub fn rebuilds(&self) -> u64 {
        self.rebuilds.load(Ordering::Relaxed)
    }

    /// The [`SlotTable::sample`] draw that reads `key`'s home slot (tests and models use it to
    /// draw a chosen slot).
    pub fn home_draw(&self, key: u64) -> u64 {
        mix(self.seed, key)
    }

    /// Where `key` is placed in a table whose segment of it has `slots` slots, seeded `seed`:
    /// keys with equal answers share a segment and a home (tests and models use it to pick
    /// keys that share a probe sequence).
    pub fn home_of(seed: u64, slots: usize, key: u64) -> usize {
        let mixed = mix(seed, key);
        let shift = 64 - SEGMENT_BITS - slots.trailing_zeros();
        segment_of(mixed) << 32 | ((mixed >> shift) as usize & (slots - 1))
    }
}

impl Drop for SlotTable {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no reader or writer is left, and the current tables are owned
        // here (replaced tables were handed to the epoch when they were replaced).
        unsafe {
            let guard = crossbeam_epoch::unprotected();
            let free = |table: &Atomic<Slots>| {
                let table = table.swap(Shared::null(), Ordering::Relaxed, guard);
                if !table.is_null() {
                    drop(table.into_owned());
                }
            };
            let word = self.root.load(Ordering::Relaxed);
            if word & 63 != 0 {
                // The single table, owned by the root word.
                drop(Slots::from_word(word));
            } else if word != 0 {
                // The directory a split leaked from its box (`SlotWriter::split`).
                let directory = Box::from_raw(word as *mut Directory);
                directory.tables.iter().for_each(free);
            }
        }
    }
}

mod writer;

pub use writer::SlotWriter;

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crossbeam_epoch as epoch;
    use std::collections::HashMap;

    fn v(x: u64) -> SlotValue {
        NonZeroU64::new(x).expect("non-zero")
    }

    /// Keys of one home in a table of `slots` slots.
    fn same_home(seed: u64, slots: usize, n: usize) -> Vec<u64> {
        let home = SlotTable::home_of(seed, slots, 1_000);
        (1_000..)
            .filter(|&k| SlotTable::home_of(seed, slots, k) == home)
            .take(n)
            .collect()
    }

    #[test]
    fn inserts_replaces_and_removes_like_a_map() {
        let t = SlotTable::with_seed(7);
        let guard = epoch::pin();
        let mut model = HashMap::new();
        let mut x = 0x1234_5678_u64;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 3_000;
            if x.is_multiple_of(3) {
                assert_eq!(t.lock().remove(key, &guard), model.remove(&key).map(v));
            } else {
                let value = step + 1;
                assert_eq!(
                    t.lock().insert(key, v(value), &guard),
                    model.insert(key, value).map(v)
                );
            }
            if step.is_multiple_of(997) {
                for k in 0..3_000 {
                    assert_eq!(t.find(k, &guard), model.get(&k).copied().map(v), "key {k}");
                }
            }
        }
        assert_eq!(t.len(), model.len());
    }

    /// The summary settles all but a few absent keys at one word: a false positive reads the
    /// key's slot line, which on a large table comes from memory. Four bits per key keep the
    /// rate near 0.5% at load 1/2 (two bits: 1.7%).
    #[test]
    fn the_summary_admits_under_one_percent_of_absent_keys() {
        let mix = |x: u64| {
            (x ^ 0x5555)
                .wrapping_mul(0xD6E8_FEB8_6659_FD93)
                .rotate_left(29)
        };
        let t = SlotTable::with_seed(3);
        let guard = epoch::pin();
        let keys = 1u64 << 16;
        let mut w = t.lock();
        for k in 0..keys {
            w.insert(mix(k), v(k + 1), &guard);
        }
        drop(w);
        let load = keys as f64 / t.capacity(&guard) as f64;
        assert!((0.375..=0.75).contains(&load), "load {load}");
        let absent = 200_000u64;
        let admitted = (keys..keys + absent)
            .filter(|k| t.may_contain(mix(*k), &guard))
            .count();
        let rate = admitted as f64 / absent as f64;
        assert!(
            rate < 0.01,
            "{admitted} of {absent} absent keys admitted at load {load}"
        );
        // Every present key is admitted (the summary is a superset).
        assert!((0..keys).all(|k| t.may_contain(mix(k), &guard)));
    }

    #[test]
    fn key_zero_and_key_one_are_ordinary_keys() {
        let t = SlotTable::with_seed(0);
        let guard = epoch::pin();
        let mut w = t.lock();
        w.insert(0, v(10), &guard);
        w.insert(1, v(11), &guard);
        assert_eq!(w.remove(0, &guard), Some(v(10)));
        drop(w);
        assert_eq!(t.find(0, &guard), None);
        assert_eq!(t.find(1, &guard), Some(v(11)));
    }

    #[test]
    fn a_vacated_slot_is_taken_again_and_probes_go_past_it() {
        let seed = 3;
        let keys = same_home(seed, MIN_SLOTS, 3);
        let t = SlotTable::with_seed(seed);
        let guard = epoch::pin();
        let mut w = t.lock();
        for (i, k) in keys.iter().enumerate() {
            w.insert(*k, v(i as u64 + 1), &guard);
        }
        // The first key's slot is vacated (its successor is live), the third still found.
        assert_eq!(w.remove(keys[0], &guard), Some(v(1)));
        drop(w);
        assert_eq!(t.find(keys[2], &guard), Some(v(3)));
        assert_eq!(t.find(keys[0], &guard), None);
        let mut w = t.lock();
        w.insert(keys[0], v(9), &guard);
        drop(w);
        assert_eq!(t.find(keys[0], &guard), Some(v(9)));
        assert_eq!(t.capacity(&guard), MIN_SLOTS, "no rebuild");
    }

    #[test]
    fn insert_absent_takes_the_first_vacated_slot_and_grows_like_insert() {
        let seed = 3;
        let keys = same_home(seed, MIN_SLOTS, 4);
        let t = SlotTable::with_seed(seed);
        let guard = epoch::pin();
        let mut w = t.lock();
        for (i, k) in keys[..3].iter().enumerate() {
            w.insert_absent(*k, v(i as u64 + 1), &guard);
        }
        // The middle key's slot is vacated; the new key of the same home takes it (no slot
        // newly used) and the key behind it is still found.
        assert_eq!(w.remove(keys[1], &guard), Some(v(2)));
        let used = w.counts.of(0).used;
        w.insert_absent(keys[3], v(4), &guard);
        assert_eq!(w.counts.of(0).used, used, "the vacated slot was taken");
        drop(w);
        assert_eq!(t.find(keys[3], &guard), Some(v(4)));
        assert_eq!(t.find(keys[2], &guard), Some(v(3)));
        assert_eq!(t.find(keys[0], &guard), Some(v(1)));
        assert_eq!(t.find(keys[1], &guard), None);
        assert_eq!(t.len(), 3);
        // Past the split and several rebuilds, with removals leaving vacated slots: the same
        // keys and capacity as `insert` gives.
        let key = |x: u64| x.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
        let (a, b) = (SlotTable::with_seed(seed), SlotTable::with_seed(seed));
        let (mut wa, mut wb) = (a.lock(), b.lock());
        for k in 0..20_000u64 {
            wa.insert_absent(key(k), v(k + 1), &guard);
            assert_eq!(wb.insert(key(k), v(k + 1), &guard), None);
            if k % 3 == 0 {
                assert_eq!(wa.remove(key(k / 2), &guard), wb.remove(key(k / 2), &guard));
            }
        }
        drop((wa, wb));
        assert_eq!(a.len(), b.len());
        assert_eq!(a.capacity(&guard), b.capacity(&guard));
        for k in 0..20_000u64 {
            assert_eq!(a.find(key(k), &guard), b.find(key(k), &guard), "key {k}");
        }
    }

    /// Keys of one segment (the segment of key 1,000), from 1,000 on.
    fn same_segment(seed: u64, n: usize) -> Vec<u64> {
        let segment = SlotTable::home_of(seed, MIN_SLOTS, 1_000) >> 32;
        (1_000..)
            .filter(|&k| SlotTable::home_of(seed, MIN_SLOTS, k) >> 32 == segment)
            .take(n)
            .collect()
    }

    #[test]
    fn segments_grow_at_three_quarters_and_shrink_below_an_eighth_when_asked() {
        let seed = 11;
        let keys = same_segment(seed, 1_000);
        let t = SlotTable::with_seed(seed);
        let guard = epoch::pin();
        assert_eq!(t.capacity(&guard), 0, "no segment before the first insert");
        for &k in &keys[..6] {
            t.lock().insert(k, v(k + 1), &guard);
        }
        assert_eq!(t.capacity(&guard), 8);
        t.lock().insert(keys[6], v(keys[6] + 1), &guard);
        assert_eq!(t.capacity(&guard), 16, "7 of 8 slots would pass 3/4");
        for &k in &keys[7..] {
            t.lock().insert(k, v(k + 1), &guard);
        }
        let big = t.capacity(&guard);
        assert!((1_334..=4_096).contains(&big), "{big}");
        for &k in &keys[10..] {
            t.lock().remove(k, &guard);
        }
        assert_eq!(t.capacity(&guard), big, "removals never rebuild");
        let s = SlotTable::home_of(seed, MIN_SLOTS, keys[0]) >> 32;
        assert_eq!(
            t.underfilled(),
            1 << s,
            "the removals flag the segment, and only it"
        );
        let mut w = t.lock();
        assert!(w.is_underfilled(s, &guard));
        assert!(w.shrink(s, &guard));
        assert!(!w.shrink(s, &guard), "a shrunk segment is not underfilled");
        drop(w);
        assert_eq!(t.underfilled(), 0, "the shrink clears its flag");
        assert!(t.capacity(&guard) <= 128, "{}", t.capacity(&guard));
        for &k in &keys[..10] {
            assert_eq!(t.find(k, &guard), Some(v(k + 1)));
        }
    }

    #[test]
    fn a_small_table_is_one_segment_until_it_passes_64_slots() {
        let t = SlotTable::with_seed(5);
        let guard = epoch::pin();
        assert_eq!(t.memory_bytes(&guard), 0, "nothing before the first insert");
        let small = std::mem::size_of::<SlotTable>();
        assert!(small <= 128, "a table without keys is {small} bytes");
        for k in 0..48u64 {
            t.lock().insert(k, v(k + 1), &guard);
            assert!(!t.is_split(), "{} keys", k + 1);
            // Every key of the single table is segment 0's, whatever its segment bits.
            let segment_lens: Vec<usize> = (0..SlotTable::segments())
                .map(|s| t.segment_capacity(s, &guard))
                .collect();
            assert_eq!(segment_lens[0], t.capacity(&guard));
            assert_eq!(segment_lens[1..].iter().sum::<usize>(), 0);
        }
        assert_eq!(t.capacity(&guard), SINGLE_MAX_SLOTS);
        let mut seen = Vec::new();
        t.for_each_value_in(0, 0, SINGLE_MAX_SLOTS, &guard, |v| seen.push(v));
        seen.sort_unstable();
        assert_eq!(seen, (1..=48).collect::<Vec<u64>>());
        let single_id = t.segment_id(0, &guard);
        let before = t.rebuilds();
        t.lock().insert(48, v(49), &guard);
        assert!(t.is_split(), "the 49th key would need 128 slots");
        // The split is one rebuild; the 49th key's insert after it creates its segment's
        // table (one more) only if none of the 48 keys was of that segment.
        let segment_of_key = |k: u64| SlotTable::home_of(5, MIN_SLOTS, k) >> 32;
        let fresh_segment = (0..48).all(|k| segment_of_key(k) != segment_of_key(48));
        assert_eq!(t.rebuilds(), before + 1 + u64::from(fresh_segment));
        assert_ne!(t.segment_id(0, &guard), single_id);
        assert_eq!(t.len(), 49);
        for k in 0..49u64 {
            assert_eq!(t.find(k, &guard), Some(v(k + 1)), "key {k}");
            assert_eq!(t.lock().get(k, &guard), Some(v(k + 1)), "key {k}");
        }
        // Each key is now in the segment of its top bits, each segment sized for its keys.
        let mut per_segment = [0usize; SEGMENTS];
        for k in 0..49u64 {
            per_segment[SlotTable::home_of(5, MIN_SLOTS, k) >> 32] += 1;
        }
        for (s, &n) in per_segment.iter().enumerate() {
            let want = if n == 0 { 0 } else { table_len(n) };
            assert_eq!(t.segment_capacity(s, &guard), want, "segment {s}");
        }
        let directory = crate::raw::pages::heap_chunk(std::mem::size_of::<Directory>());
        assert!(t.memory_bytes(&guard) > directory);
        for k in 0..49u64 {
            assert_eq!(t.lock().remove(k, &guard), Some(v(k + 1)));
        }
        assert!(t.is_empty() && t.is_split(), "a split is never undone");
        assert_eq!(t.find(3, &guard), None);
    }

    #[test]
    fn a_rebuild_replaces_one_segment_and_leaves_the_others() {
        let seed = 13;
        let t = SlotTable::with_seed(seed);
        let guard = epoch::pin();
        for k in 0..20_000u64 {
            t.lock().insert(k, v(k + 1), &guard);
        }
        let ids: Vec<u64> = (0..SlotTable::segments())
            .map(|s| t.segment_id(s, &guard))
            .collect();
        let lens: Vec<usize> = (0..SlotTable::segments())
            .map(|s| t.segment_capacity(s, &guard))
            .collect();
        // Every segment holds about 20,000 / 64 keys: none is more than 1/32 of the table.
        assert!(
            lens.iter().all(|&l| l * 32 <= t.capacity(&guard)),
            "{lens:?}"
        );
        // Grow the segment of key 1,000 only.
        let grown = SlotTable::home_of(seed, MIN_SLOTS, 1_000) >> 32;
        let before = t.rebuilds();
        for k in same_segment(seed, 4_000)
            .into_iter()
            .filter(|&k| k >= 20_000)
        {
            t.lock().insert(k, v(k + 1), &guard);
        }
        assert!(t.rebuilds() > before);
        for (s, &id) in ids.iter().enumerate() {
            assert_eq!(t.segment_id(s, &guard) != id, s == grown, "segment {s}");
        }
        for k in 0..20_000u64 {
            assert_eq!(t.find(k, &guard), Some(v(k + 1)));
        }
    }

    #[test]
    fn a_scan_cursor_visits_every_live_slot_once_per_lap() {
        let t = SlotTable::with_seed(17);
        let guard = epoch::pin();
        for k in 0..5_000u64 {
            t.lock().insert(k, v(k + 1), &guard);
        }
        let lap = t.scan_len(&guard);
        assert_eq!(lap % SlotTable::segments(), 0);
        let mut seen = Vec::new();
        let mut cursor = 12_345 % lap;
        let mut done = 0;
        while done < lap {
            let step = 777.min(lap - done);
            cursor = t.for_each_value_from(cursor, step, &guard, |value| seen.push(value));
            done += step;
        }
        assert_eq!(cursor, 12_345 % lap, "a lap ends where it started");
        seen.sort_unstable();
        assert_eq!(seen, (1..=5_000).collect::<Vec<u64>>());
    }

    #[test]
    fn a_find_past_the_summary_answers_as_find_does() {
        let t = SlotTable::with_seed(31);
        let guard = epoch::pin();
        for k in 0..3_000u64 {
            t.lock().insert(k * 7, v(k + 1), &guard);
        }
        for k in (0..3_000u64).step_by(3) {
            t.lock().remove(k * 7, &guard);
        }
        for key in 0..21_000u64 {
            assert_eq!(
                t.find_present(key, &guard),
                t.find(key, &guard),
                "key {key}"
            );
        }
    }

    #[test]
    fn a_sample_draw_picks_segments_and_their_slots_alike() {
        let t = SlotTable::with_seed(23);
        let guard = epoch::pin();
        for k in 0..2_000u64 {
            t.lock().insert(k, v(k + 1), &guard);
        }
        // Draws over every slot of every segment: the top bits pick the segment, the next ones
        // its slot, so walking both hits each slot of the current tables exactly once.
        let mut seen = Vec::new();
        let mut draws = 0;
        for s in 0..SlotTable::segments() as u64 {
            let len = t.segment_capacity(s as usize, &guard) as u64;
            for i in 0..len {
                let random =
                    s << (64 - SEGMENT_BITS) | i << (64 - SEGMENT_BITS - len.trailing_zeros());
                draws += 1;
                if let Some(value) = t.sample(random, &guard) {
                    seen.push(value);
                }
            }
        }
        assert_eq!(draws, t.capacity(&guard));
        seen.sort_unstable();
        assert_eq!(seen, (1..=2_000).collect::<Vec<u64>>());
        // A removed key is never drawn.
        for k in 0..1_000u64 {
            t.lock().remove(k, &guard);
        }
        let mut state = 99u64;
        for _ in 0..20_000 {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let random = state.wrapping_mul(0xbf58_476d_1ce4_e5b9).rotate_left(29);
            if let Some(value) = t.sample(random, &guard) {
                assert!(value > 1_000, "drew removed key {}", value - 1);
            }
        }
    }

    #[test]
    fn churn_at_a_steady_size_does_not_fill_a_segment_with_tombstones() {
        let seed = 5;
        let keys = same_segment(seed, 50_000);
        let t = SlotTable::with_seed(seed);
        let guard = epoch::pin();
        for &k in &keys[..500] {
            t.lock().insert(k, v(k + 1), &guard);
        }
        let len = t.capacity(&guard);
        assert_eq!(len, 1_024, "one segment, load ≤ 1/2");
        for i in 500..keys.len() {
            let mut w = t.lock();
            w.remove(keys[i - 500], &guard);
            w.insert(keys[i], v(keys[i] + 1), &guard);
        }
        assert!(
            t.capacity(&guard) <= 2 * len,
            "{} vs {len}",
            t.capacity(&guard)
        );
        for &k in &keys[keys.len() - 500..] {
            assert_eq!(t.find(k, &guard), Some(v(k + 1)));
        }
        assert_eq!(t.find(keys[3], &guard), None);
    }

    #[test]
    fn readers_race_writers_and_see_only_values_their_key_held() {
        // Values encode their key: a reader must never see another key's value.
        let t = std::sync::Arc::new(SlotTable::with_seed(9));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = std::sync::Arc::new(AtomicU64::new(0));
        let reader = {
            let (t, stop, seen) = (t.clone(), stop.clone(), seen.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let guard = epoch::pin();
                    for k in 0..64u64 {
                        if let Some(x) = t.find(k, &guard) {
                            assert_eq!(x.get() >> 32, k, "key {k} read value {x}");
                            seen.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        };
        // At least 3,000 rounds, and on until the reader has read while the writer writes (a
        // loaded host may start it late), for at most a minute.
        let started = std::time::Instant::now();
        for round in 1u64.. {
            if round >= 3_000
                && (seen.load(Ordering::Relaxed) >= 1_000
                    || started.elapsed() > std::time::Duration::from_secs(60))
            {
                break;
            }
            let guard = epoch::pin();
            let mut w = t.lock();
            for k in 0..64u64 {
                if (k + round).is_multiple_of(3) {
                    w.remove(k, &guard);
                } else {
                    w.insert(k, v(k << 32 | round), &guard);
                }
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        reader.join().expect("reader");
        assert!(
            seen.load(Ordering::Relaxed) > 0,
            "the reader read during the writes"
        );
    }
}
