//! Key-inline slots: the key table of the run layout (`docs/perf-log.md`, "The run layout").
//!
//! The index today keys its entries through 4-byte lanes that carry a fingerprint and a node
//! index, so every fingerprint match reads the node (and, for a run node, the run's key line)
//! before it knows whether the key is the one probed for, and every move of a growth rebuild
//! reads both. A [`SlotTable`] keeps the key in the slot: a probe is settled in its slot line,
//! and a rebuild reads only the old slots. The run layout names `(run, offset)` in the slot's
//! value; this table does not interpret values beyond "non-zero".
//!
//! # Structure
//!
//! A table is a power-of-two array of 16-byte slots `{key, value}`, probed linearly from the
//! key's home (the top bits of the seeded, multiplied key), and a **presence summary**: one
//! 64-bit word per 8 slots in which every key present sets two bits chosen by its hash (a
//! superset: bits are cleared only by a rebuild), so most absent keys stop at one word, 1/16 the
//! size of the slots and usually cached. At the loads the table keeps (3/8 to 3/4) a word holds
//! 3 to 6 keys, so an absent key finds both its bits set about 3–10% of the time (with 32 slots
//! per word, 40%: a miss then read its slot line from memory). A slot is
//!
//! - **live**: `value != 0`; `key` is its key;
//! - **vacated** (a tombstone): `value == 0`, `key != 0`; a probe goes on past it, an insert may
//!   take it. A removed key 0 leaves key 1 behind, so that it does not read as empty;
//! - **empty**: `value == 0`, `key == 0`; a probe stops there.
//!
//! A removal whose next slot is empty leaves its slot empty rather than vacated: no key can sit
//! past an empty slot on a probe sequence through it, so the chain ends there anyway, and churn
//! at a steady size does not fill the table with tombstones. Writers keep at most 3/4 of the
//! slots live or vacated (there is always an empty slot); a table that would pass it is rebuilt
//! at twice its live keys, rounded up to a power of two (load ≤ 1/2 afterwards), and one whose
//! live keys fall below 1/8 of its slots is rebuilt smaller.
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
//! - A rebuild fills a new table with Relaxed stores and publishes it with a Release store of
//!   the table pointer (readers load it with Acquire); the old table is never written again and
//!   is freed through the epoch, so a reader still on it reads a consistent older state.
//! - A reader's probe is bounded by the table's length, so it ends even on a table whose
//!   writers keep moving its empty slots.
//!
//! Loom model m13a checks a reader against the insert, replace, removal and reuse of its
//! slot; m13b against a growth rebuild.

use crate::raw::pages::PageArray;
use crate::sync::{AtomicU64, Mutex, MutexGuard, Ordering};
use crossbeam_epoch::{Atomic, Guard, Owned, Shared};
use std::num::NonZeroU64;

/// A slot's value: never 0 (0 marks a slot without a key).
pub type SlotValue = NonZeroU64;

/// Slots of the smallest table (a power of two).
const MIN_SLOTS: usize = 8;
/// Slots per presence-summary word.
const SUMMARY_SLOTS: usize = 8;
/// Multiplier of the home position (Fibonacci hashing: the top bits of `key · φ⁻¹ · 2⁶⁴`).
const HOME_MIX: u64 = 0x9E37_79B9_7F4A_7C15;
/// Multiplier of the summary bits (independent of the home's bits).
const SUMMARY_MIX: u64 = 0xC2B2_AE3D_27D4_EB4F;

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

/// The home slot of `key`: the top bits of the seeded, multiplied key.
pub(crate) fn home(seed: u64, shift: u32, key: u64) -> usize {
    ((key ^ seed).wrapping_mul(HOME_MIX) >> shift) as usize
}

/// The home shift of a table of `slots` slots (a power of two): `64 − log2(slots)`.
fn shift_for(slots: usize) -> u32 {
    64 - slots.trailing_zeros()
}

#[repr(C, align(16))]
struct Slot {
    key: AtomicU64,
    value: AtomicU64,
}

/// One table: slots, summary words, and what places a key in them.
struct Slots {
    /// In page-granular blocks (`raw/pages.rs`): a table a rebuild replaces goes back to the
    /// system when freed, so RSS follows the tables' sizes under churn; and each 16-byte slot
    /// sits inside one cache line (the block is line-aligned).
    slots: PageArray<Slot>,
    summary: PageArray<AtomicU64>,
    /// `64 − log2(slots)`: the home is the top bits of the mixed key.
    shift: u32,
    seed: u64,
}

impl Slots {
    fn new(len: usize, seed: u64) -> Self {
        debug_assert!(len.is_power_of_two() && len >= MIN_SLOTS);
        let slots = PageArray::new(len, |_| Slot {
            key: AtomicU64::new(0),
            value: AtomicU64::new(0),
        });
        let summary = PageArray::new(len.div_ceil(SUMMARY_SLOTS), |_| AtomicU64::new(0));
        Slots {
            slots,
            summary,
            shift: shift_for(len),
            seed,
        }
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    fn home(&self, key: u64) -> usize {
        home(self.seed, self.shift, key)
    }

    fn summary_bits(&self, key: u64) -> u64 {
        let x = (key ^ self.seed).wrapping_mul(SUMMARY_MIX);
        1 << (x & 63) | 1 << ((x >> 6) & 63)
    }

    fn summary_word(&self, home: usize) -> &AtomicU64 {
        &self.summary[home / SUMMARY_SLOTS]
    }

    fn bytes(&self) -> usize {
        crate::raw::pages::heap_chunk(std::mem::size_of::<Slots>())
            + self.slots.footprint()
            + self.summary.footprint()
    }

    /// Writer side: the index of the live slot holding `key`, and the first vacated or empty
    /// slot of its probe sequence (where an insert of `key` goes).
    fn locate(&self, key: u64) -> (Option<usize>, usize) {
        let mask = self.mask();
        let mut i = self.home(key);
        let mut free = None;
        for _ in 0..=mask {
            let slot = &self.slots[i];
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

    /// Writer side: stores `key → value` into slot `i`, vacated or empty (summary bits, key,
    /// then the value that publishes it).
    fn fill(&self, i: usize, key: u64, value: SlotValue) {
        let word = self.summary_word(self.home(key));
        let bits = self.summary_bits(key);
        word.store(word.load(Ordering::Relaxed) | bits, Ordering::Relaxed);
        let slot = &self.slots[i];
        slot.key.store(key, Ordering::Relaxed);
        slot.value.store(value.get(), Ordering::Release);
    }
}

/// Writer-side counts (under the writer lock).
#[derive(Default)]
struct Counts {
    /// Live slots.
    live: usize,
    /// Live and vacated slots.
    used: usize,
}

/// A table of key-inline slots; see the module docs.
pub struct SlotTable {
    current: Atomic<Slots>,
    writer: Mutex<Counts>,
    /// Live keys, for readers of the size (Relaxed; exact once writers quiesce).
    live: AtomicU64,
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
            current: Atomic::new(Slots::new(MIN_SLOTS, seed)),
            writer: Mutex::new(Counts::default()),
            live: AtomicU64::new(0),
            seed,
        }
    }

    /// The value of `key`, if present (lock-free; see "Memory ordering").
    #[inline]
    pub fn find(&self, key: u64, guard: &Guard) -> Option<SlotValue> {
        let table = self.current.load(Ordering::Acquire, guard);
        // SAFETY: the table pointer is never null (set at construction, replaced by rebuilds),
        // and a replaced table is freed only through the epoch, after `guard`.
        let table = unsafe { table.deref() };
        let home = table.home(key);
        let bits = table.summary_bits(key);
        if table.summary_word(home).load(Ordering::Relaxed) & bits != bits {
            return None;
        }
        let mask = table.mask();
        let mut i = home;
        for _ in 0..=mask {
            let slot = &table.slots[i];
            let first = slot.key.load(Ordering::Acquire);
            let value = slot.value.load(Ordering::Acquire);
            if value == 0 {
                if first == 0 {
                    return None;
                }
            } else if first == key && slot.key.load(Ordering::Relaxed) == key {
                return NonZeroU64::new(value);
            }
            i = (i + 1) & mask;
        }
        None
    }

    /// Whether `key` may be present: false when its presence-summary bits are not both set
    /// (one load; the summary is a superset, so true proves nothing).
    #[inline]
    pub fn may_contain(&self, key: u64, guard: &Guard) -> bool {
        let table = self.current.load(Ordering::Acquire, guard);
        // SAFETY: as in `find`.
        let table = unsafe { table.deref() };
        let bits = table.summary_bits(key);
        table.summary_word(table.home(key)).load(Ordering::Relaxed) & bits == bits
    }

    /// Prefetches the summary word of `key`: what a later [`SlotTable::find`] of a key likely
    /// absent reads.
    #[inline]
    pub fn prefetch_summary(&self, key: u64, guard: &Guard) {
        let table = self.current.load(Ordering::Acquire, guard);
        // SAFETY: as in `find`.
        let table = unsafe { table.deref() };
        prefetch(std::ptr::from_ref(table.summary_word(table.home(key))));
    }

    /// Prefetches the summary word and home slot line of `key` (a later [`SlotTable::find`]).
    #[inline]
    pub fn prefetch(&self, key: u64, guard: &Guard) {
        let table = self.current.load(Ordering::Acquire, guard);
        // SAFETY: as in `find`.
        let table = unsafe { table.deref() };
        let home = table.home(key);
        prefetch(std::ptr::from_ref(&table.slots[home]));
        // The next line too: at the loads writers keep, a probe often runs past its home line.
        prefetch(std::ptr::from_ref(
            &table.slots[((home | 3) + 1) & table.mask()],
        ));
        prefetch(std::ptr::from_ref(table.summary_word(home)));
    }

    /// Live keys (Relaxed: may lag a concurrent writer).
    pub fn len(&self) -> usize {
        self.live.load(Ordering::Relaxed) as usize
    }

    /// Whether the table holds no key (as [`SlotTable::len`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the current table (slots, summary, header).
    pub fn memory_bytes(&self, guard: &Guard) -> usize {
        let table = self.current.load(Ordering::Acquire, guard);
        // SAFETY: as in `find`.
        unsafe { table.deref() }.bytes()
    }

    /// The writer lock: every change goes through the returned writer.
    pub fn lock(&self) -> SlotWriter<'_> {
        SlotWriter {
            table: self,
            counts: self.writer.lock(),
        }
    }

    /// Calls `f` with the value of every live slot of the current table (writers and owners:
    /// a concurrent writer may move values past the visit).
    pub fn for_each_value(&self, guard: &Guard, mut f: impl FnMut(u64)) {
        let table = self.current.load(Ordering::Acquire, guard);
        // SAFETY: as in `SlotTable::find`: the table stays allocated while `guard` is pinned.
        let table = unsafe { table.deref() };
        for s in table.slots.iter() {
            let v = s.value.load(Ordering::Acquire);
            if v != 0 {
                f(v);
            }
        }
    }

    /// Calls `f` with the value of every live slot among `count` slots of the current table
    /// from position `from` on (wrapping at its end; positions of a table a rebuild replaced
    /// are taken modulo the new one's length), and returns the position after the last slot
    /// visited: a cursor for a scan spread over many calls (the cap's sampling hand). A
    /// concurrent writer may move values past the visit, as in [`SlotTable::for_each_value`].
    pub fn for_each_value_from(
        &self,
        from: usize,
        count: usize,
        guard: &Guard,
        mut f: impl FnMut(u64),
    ) -> usize {
        let table = self.current.load(Ordering::Acquire, guard);
        // SAFETY: as in `SlotTable::find`: the table stays allocated while `guard` is pinned.
        let table = unsafe { table.deref() };
        let mask = table.mask();
        let mut at = from & mask;
        for _ in 0..count.min(table.slots.len()) {
            let v = table.slots[at].value.load(Ordering::Acquire);
            if v != 0 {
                f(v);
            }
            at = (at + 1) & mask;
        }
        at
    }

    /// Slot count of the current table (tests and models).
    pub fn capacity(&self, guard: &Guard) -> usize {
        let table = self.current.load(Ordering::Acquire, guard);
        // SAFETY: as in `find`.
        unsafe { table.deref() }.slots.len()
    }

    /// Which table is current: equal answers under one pinned guard mean no rebuild replaced
    /// it between them (a replaced table is not freed, so its address not reused, while the
    /// guard is pinned).
    pub fn table_id(&self, guard: &Guard) -> usize {
        self.current.load(Ordering::Acquire, guard).as_raw() as usize
    }

    /// The home slot of `key` in a table of `slots` slots seeded `seed` (tests and models use it
    /// to pick keys that share a probe sequence).
    pub fn home_of(seed: u64, slots: usize, key: u64) -> usize {
        home(seed, shift_for(slots), key)
    }
}

impl Drop for SlotTable {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no reader or writer is left, and the current table is owned
        // here (replaced tables were handed to the epoch when they were replaced).
        unsafe {
            let guard = crossbeam_epoch::unprotected();
            let table = self.current.swap(Shared::null(), Ordering::Relaxed, guard);
            if !table.is_null() {
                drop(table.into_owned());
            }
        }
    }
}

/// A holder of a [`SlotTable`]'s writer lock.
pub struct SlotWriter<'t> {
    table: &'t SlotTable,
    counts: MutexGuard<'t, Counts>,
}

impl SlotWriter<'_> {
    fn current<'g>(&self, guard: &'g Guard) -> &'g Slots {
        let table = self.table.current.load(Ordering::Relaxed, guard);
        // SAFETY: as in `SlotTable::find`; only this lock's holder replaces the table.
        unsafe { table.deref() }
    }

    /// Stores the live count for [`SlotTable::len`] (a plain store: only this lock's holder
    /// writes it).
    fn publish_len(&self) {
        self.table
            .live
            .store(self.counts.live as u64, Ordering::Relaxed);
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: u64, guard: &Guard) -> Option<SlotValue> {
        let table = self.current(guard);
        let (at, _) = table.locate(key);
        at.and_then(|i| NonZeroU64::new(table.slots[i].value.load(Ordering::Relaxed)))
    }

    /// Sets `key → value`; returns the value it replaced, if the key was present.
    pub fn insert(&mut self, key: u64, value: SlotValue, guard: &Guard) -> Option<SlotValue> {
        let table = self.current(guard);
        let (at, free) = table.locate(key);
        if let Some(i) = at {
            // Plain load and store, no locked instruction: only this lock's holder writes.
            let slot = &table.slots[i].value;
            let old = slot.load(Ordering::Relaxed);
            slot.store(value.get(), Ordering::Release);
            return NonZeroU64::new(old);
        }
        let fills_empty = table.slots[free].key.load(Ordering::Relaxed) == 0;
        let used = self.counts.used + usize::from(fills_empty);
        if used * 4 > table.slots.len() * 3 {
            let table = self.rebuild(self.counts.live + 1, guard);
            let (_, free) = table.locate(key);
            table.fill(free, key, value);
            self.counts.used += 1;
        } else {
            table.fill(free, key, value);
            self.counts.used = used;
        }
        self.counts.live += 1;
        self.publish_len();
        None
    }

    /// Removes `key`; returns its value, if it was present.
    pub fn remove(&mut self, key: u64, guard: &Guard) -> Option<SlotValue> {
        let table = self.current(guard);
        let (Some(i), _) = table.locate(key) else {
            return None;
        };
        let slot = &table.slots[i];
        let old = slot.value.load(Ordering::Relaxed);
        slot.value.store(0, Ordering::Release);
        let next = &table.slots[(i + 1) & table.mask()];
        let next_empty =
            next.value.load(Ordering::Relaxed) == 0 && next.key.load(Ordering::Relaxed) == 0;
        if next_empty {
            slot.key.store(0, Ordering::Release);
            self.counts.used -= 1;
        } else if key == 0 {
            slot.key.store(1, Ordering::Release);
        }
        self.counts.live -= 1;
        self.publish_len();
        if table.slots.len() > MIN_SLOTS && self.counts.live * 8 < table.slots.len() {
            self.rebuild(self.counts.live, guard);
        }
        NonZeroU64::new(old)
    }

    /// Replaces the table by one sized for `live` keys at load ≤ 1/2 holding the live slots,
    /// and retires the old one through the epoch.
    fn rebuild<'g>(&mut self, live: usize, guard: &'g Guard) -> &'g Slots {
        let old = self.table.current.load(Ordering::Relaxed, guard);
        // SAFETY: as in `current`.
        let old_table = unsafe { old.deref() };
        let len = (live * 2).next_power_of_two().max(MIN_SLOTS);
        let fresh = Slots::new(len, self.table.seed);
        let mut moved = 0;
        for slot in old_table.slots.iter() {
            let value = slot.value.load(Ordering::Relaxed);
            if let Some(value) = NonZeroU64::new(value) {
                let key = slot.key.load(Ordering::Relaxed);
                let (_, free) = fresh.locate(key);
                fresh.fill(free, key, value);
                moved += 1;
            }
        }
        self.counts.used = moved;
        let fresh = self
            .table
            .current
            .swap(Owned::new(fresh), Ordering::Release, guard);
        // SAFETY: the old table is unlinked (readers that loaded it are pinned) and no writer
        // touches it again; the epoch frees it after them.
        unsafe { guard.defer_destroy(fresh) };
        // A table is large and rebuilds are rare: hand it to the collector now rather than when
        // this thread's bag fills, so memory follows the live table.
        guard.flush();
        let table = self.table.current.load(Ordering::Relaxed, guard);
        // SAFETY: just stored, and replaced only under this lock.
        unsafe { table.deref() }
    }
}

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
    fn tables_grow_at_three_quarters_and_shrink_below_an_eighth() {
        let t = SlotTable::with_seed(11);
        let guard = epoch::pin();
        for k in 0..6 {
            t.lock().insert(k, v(k + 1), &guard);
        }
        assert_eq!(t.capacity(&guard), 8);
        t.lock().insert(6, v(7), &guard);
        assert_eq!(t.capacity(&guard), 16, "7 of 8 slots would pass 3/4");
        for k in 7..1_000 {
            t.lock().insert(k, v(k + 1), &guard);
        }
        let big = t.capacity(&guard);
        assert!((1_334..=4_096).contains(&big), "{big}");
        for k in 10..1_000 {
            t.lock().remove(k, &guard);
        }
        assert!(t.capacity(&guard) <= 128, "{}", t.capacity(&guard));
        for k in 0..10 {
            assert_eq!(t.find(k, &guard), Some(v(k + 1)));
        }
    }

    #[test]
    fn churn_at_a_steady_size_does_not_fill_the_table_with_tombstones() {
        let t = SlotTable::with_seed(5);
        let guard = epoch::pin();
        for k in 0..500 {
            t.lock().insert(k, v(k + 1), &guard);
        }
        let len = t.capacity(&guard);
        for k in 500..200_000u64 {
            let mut w = t.lock();
            w.remove(k - 500, &guard);
            w.insert(k, v(k + 1), &guard);
        }
        assert!(
            t.capacity(&guard) <= 2 * len,
            "{} vs {len}",
            t.capacity(&guard)
        );
        for k in 200_000 - 500..200_000 {
            assert_eq!(t.find(k, &guard), Some(v(k + 1)));
        }
        assert_eq!(t.find(3, &guard), None);
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
