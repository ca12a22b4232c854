//! The table's writer side: [`SlotTable::lock`] and what its holder does (insert, replace,
//! remove, grow, split, shrink; see the room's docs for the protocol each follows).

use super::*;

/// Where a write of a key goes: its segment `s`, that segment's `table`, the vacated or empty
/// slot `free` of its probe sequence, its mixed hash and its summary bits.
#[derive(Clone, Copy)]
struct Place<'g> {
    s: usize,
    table: View<'g>,
    free: usize,
    mixed: u64,
    bits: u64,
}

impl SlotTable {
    /// The writer lock: every change goes through the returned writer.
    pub fn lock(&self) -> SlotWriter<'_> {
        SlotWriter {
            table: self,
            counts: self.writer.lock(),
        }
    }
}

/// A holder of a [`SlotTable`]'s writer lock.
pub struct SlotWriter<'t> {
    pub(super) table: &'t SlotTable,
    pub(super) counts: MutexGuard<'t, Counts>,
}

impl SlotWriter<'_> {
    /// Segment `s`'s current table, if it has one.
    pub(super) fn current<'g>(&self, s: usize, guard: &'g Guard) -> Option<View<'g>> {
        self.table.segment(s, guard)
    }

    /// The segment whose counts and table hold the mixed key `mixed`: 0 (the single table)
    /// before the split.
    pub(super) fn segment_index(&self, mixed: u64) -> usize {
        if self.counts.segments.is_some() {
            segment_of(mixed)
        } else {
            0
        }
    }

    /// Adds `delta` to the live count of [`SlotTable::len`] (a plain load and store: only this
    /// lock's holder writes it, so it is the writer's count as well as the readers').
    pub(super) fn add_live(&self, delta: i64) {
        let live = self.table.live.load(Ordering::Relaxed);
        self.table
            .live
            .store(live.wrapping_add_signed(delta), Ordering::Relaxed);
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: u64, guard: &Guard) -> Option<SlotValue> {
        let mixed = mix(self.table.seed, key);
        let table = self.current(self.segment_index(mixed), guard)?;
        let (at, _) = table.locate(key, mixed);
        at.and_then(|i| NonZeroU64::new(table.slot(i).value.load(Ordering::Relaxed)))
    }

    /// Where a write of `key` begins: its mixed hash, its summary bits, its segment, and that
    /// segment's table (made empty if the segment has none yet).
    fn write_start<'g>(&mut self, key: u64, guard: &'g Guard) -> (u64, u64, usize, View<'g>) {
        let seed = self.table.seed;
        let (mixed, bits) = (mix(seed, key), summary_bits(seed, key));
        let s = self.segment_index(mixed);
        let table = match self.current(s, guard) {
            Some(table) => table,
            None => self.rebuild(s, 0, guard),
        };
        (mixed, bits, s, table)
    }

    /// Sets `key → value`; returns the value it replaced, if the key was present.
    pub fn insert(&mut self, key: u64, value: SlotValue, guard: &Guard) -> Option<SlotValue> {
        let (mixed, bits, s, table) = self.write_start(key, guard);
        let (at, free) = table.locate(key, mixed);
        if let Some(i) = at {
            // Plain load and store, no locked instruction: only this lock's holder writes.
            let slot = &table.slot(i).value;
            let old = slot.load(Ordering::Relaxed);
            slot.store(value.get(), Ordering::Release);
            return NonZeroU64::new(old);
        }
        let at = Place {
            s,
            table,
            free,
            mixed,
            bits,
        };
        if self.fill_unless_full(at, key, value) {
            return None;
        }
        let live = self.counts.of(s).live as usize + 1;
        if self.counts.segments.is_none() && table_len(live) > SINGLE_MAX_SLOTS {
            self.split(guard);
            return self.insert(key, value, guard);
        }
        let table = self.rebuild(s, live, guard);
        let (_, free) = table.locate(key, mixed);
        table.fill(free, key, mixed, bits, value);
        let counts = self.counts.of_mut(s);
        counts.used += 1;
        counts.live += 1;
        self.add_live(1);
        None
    }

    /// Stores `key → value` into `at.free` unless that would pass 3/4 of its segment's slots
    /// used (the caller grows the segment then); returns whether it did.
    #[inline(always)]
    fn fill_unless_full(&mut self, at: Place<'_>, key: u64, value: SlotValue) -> bool {
        let Place {
            s,
            table,
            free,
            mixed,
            bits,
        } = at;
        let fills_empty = table.slot(free).key.load(Ordering::Relaxed) == 0;
        let used = self.counts.of(s).used as usize + usize::from(fills_empty);
        if used * 4 > table.len() * 3 {
            return false;
        }
        table.fill(free, key, mixed, bits, value);
        let counts = self.counts.of_mut(s);
        counts.used = used as u32;
        counts.live += 1;
        self.add_live(1);
        true
    }

    /// Sets `key → value` for a key the caller knows is absent (it found none under this
    /// store's writer lock, and nothing inserted it since): as [`SlotWriter::insert`], but the
    /// key goes into the first vacated or empty slot of its probe sequence without the probe
    /// going on to an empty slot to prove the key absent. Under churn, vacated slots make that
    /// proof the longer part of an insert's probe (a new block of a store's chain, the
    /// Mooncake replay's most common write).
    pub fn insert_absent(&mut self, key: u64, value: SlotValue, guard: &Guard) {
        let (mixed, bits, s, table) = self.write_start(key, guard);
        debug_assert!(
            table.locate(key, mixed).0.is_none(),
            "insert_absent of a present key"
        );
        let at = Place {
            s,
            table,
            free: table.locate_free(mixed),
            mixed,
            bits,
        };
        if !self.fill_unless_full(at, key, value) {
            // The growth path is `insert`'s (split or rebuild, then the fresh table's slot).
            let replaced = self.insert(key, value, guard);
            debug_assert!(replaced.is_none());
        }
    }

    /// Removes `key`; returns its value, if it was present.
    pub fn remove(&mut self, key: u64, guard: &Guard) -> Option<SlotValue> {
        let mixed = mix(self.table.seed, key);
        let s = self.segment_index(mixed);
        let table = self.current(s, guard)?;
        let (Some(i), _) = table.locate(key, mixed) else {
            return None;
        };
        let slot = table.slot(i);
        let old = slot.value.load(Ordering::Relaxed);
        slot.value.store(0, Ordering::Release);
        let next = table.slot(i + 1);
        let next_empty =
            next.value.load(Ordering::Relaxed) == 0 && next.key.load(Ordering::Relaxed) == 0;
        let counts = self.counts.of_mut(s);
        if next_empty {
            slot.key.store(0, Ordering::Release);
            counts.used -= 1;
        } else if key == 0 {
            slot.key.store(1, Ordering::Release);
        }
        counts.live -= 1;
        self.add_live(-1);
        if self.is_underfilled(s, guard) {
            self.mark_underfilled(s, true);
        }
        NonZeroU64::new(old)
    }

    /// Sets or clears segment `s`'s bit of [`SlotTable::underfilled`] (plain stores: only this
    /// lock's holder writes the word).
    pub(super) fn mark_underfilled(&self, s: usize, underfilled: bool) {
        let word = &self.table.underfilled;
        let bits = word.load(Ordering::Relaxed);
        let bits = if underfilled {
            bits | 1 << s
        } else {
            bits & !(1 << s)
        };
        word.store(bits, Ordering::Relaxed);
    }

    /// Whether segment `s` has fallen below 1/8 of its slots live, and [`SlotWriter::shrink`]
    /// would rebuild it.
    pub fn is_underfilled(&self, s: usize, guard: &Guard) -> bool {
        self.current(s, guard).is_some_and(|table| {
            table.len() > MIN_SLOTS && (self.counts.of(s).live as usize) * 8 < table.len()
        })
    }

    /// Rebuilds segment `s` smaller if its live keys have fallen below 1/8 of its slots (at
    /// load ≤ 1/2, like every rebuild); returns whether it did. Removals never shrink a
    /// segment themselves (module docs, "Structure").
    pub fn shrink(&mut self, s: usize, guard: &Guard) -> bool {
        let underfilled = self.is_underfilled(s, guard);
        self.mark_underfilled(s, false);
        if !underfilled {
            return false;
        }
        let live = self.counts.of(s).live as usize;
        self.rebuild(s, live, guard);
        true
    }

    /// Replaces segment `s`'s table by one sized for `live` keys at load ≤ 1/2 holding its
    /// live slots, and retires the old one (if any) through the epoch.
    pub(super) fn rebuild<'g>(&mut self, s: usize, live: usize, guard: &'g Guard) -> View<'g> {
        let seed = self.table.seed;
        let fresh = Slots::new(table_len(live));
        let word = fresh.view_word();
        let mut moved = 0;
        {
            let into = View::of(word).expect("a table's block is never at address 0");
            if let Some(old_table) = self.current(s, guard) {
                for i in 0..old_table.len() {
                    let slot = old_table.slot(i);
                    let value = slot.value.load(Ordering::Relaxed);
                    if let Some(value) = NonZeroU64::new(value) {
                        let key = slot.key.load(Ordering::Relaxed);
                        let mixed = mix(seed, key);
                        let (_, free) = into.locate(key, mixed);
                        into.fill(free, key, mixed, summary_bits(seed, key), value);
                        moved += 1;
                    }
                }
            }
        }
        self.counts.of_mut(s).used = moved;
        self.count_rebuild();
        let old = match self.table.root() {
            Root::Directory(directory) => {
                let old = directory.tables[s].swap(Owned::new(fresh), Ordering::Relaxed, guard);
                // Release: the new table's slots and summary before its view word.
                directory.views[s].store(word, Ordering::Release);
                old
            }
            Root::Empty | Root::Single(_) => {
                let old = self.table.root.load(Ordering::Relaxed);
                // Release: the new table's slots and summary before the root names it (and
                // owns its block).
                self.table.root.store(fresh.into_word(), Ordering::Release);
                self.retire_word(old, guard);
                Shared::null()
            }
        };
        self.retire(old, guard);
        View::of(word).expect("a table's block is never at address 0")
    }

    /// Adds one to the table's rebuild count (a plain store: only this lock's holder writes
    /// it; unit tests only, see `SlotTable::rebuilds`).
    pub(super) fn count_rebuild(&self) {
        #[cfg(test)]
        self.table.rebuilds.store(
            self.table.rebuilds.load(Ordering::Relaxed) + 1,
            Ordering::Relaxed,
        );
    }

    /// Splits the single table into the directory's segments, each sized for its keys at load
    /// ≤ 1/2, and publishes the directory; the single table is retired through the epoch. A
    /// reader still on it reads a consistent older state, as after any rebuild.
    pub(super) fn split(&mut self, guard: &Guard) {
        let seed = self.table.seed;
        let old = self.current(0, guard);
        let mut live = [0usize; SEGMENTS];
        let each_live = |f: &mut dyn FnMut(u64, u64)| {
            if let Some(old) = old {
                for i in 0..old.len() {
                    let slot = old.slot(i);
                    let value = slot.value.load(Ordering::Relaxed);
                    if value != 0 {
                        f(slot.key.load(Ordering::Relaxed), value);
                    }
                }
            }
        };
        each_live(&mut |key, _| live[segment_of(mix(seed, key))] += 1);
        let directory = Box::new(Directory {
            views: std::array::from_fn(|_| AtomicU64::new(0)),
            tables: std::array::from_fn(|_| Atomic::null()),
        });
        let mut counts = Box::new([SegmentCounts::default(); SEGMENTS]);
        for (s, &n) in live.iter().enumerate().filter(|&(_, &n)| n > 0) {
            let fresh = Slots::new(table_len(n));
            // Relaxed: the directory is not reachable yet; its publication below releases it.
            directory.views[s].store(fresh.view_word(), Ordering::Relaxed);
            directory.tables[s].store(Owned::new(fresh), Ordering::Relaxed);
            counts[s] = SegmentCounts {
                live: n as u32,
                used: n as u32,
            };
        }
        each_live(&mut |key, value| {
            let mixed = mix(seed, key);
            let into = View::of(directory.views[segment_of(mixed)].load(Ordering::Relaxed))
                .expect("a segment with a live key got a table above");
            let (_, free) = into.locate(key, mixed);
            if let Some(value) = NonZeroU64::new(value) {
                into.fill(free, key, mixed, summary_bits(seed, key), value);
            }
        });
        self.counts.segments = Some(counts);
        self.count_rebuild();
        // Segment 0's bit was the single table's; the new segments are at load ≥ 1/8.
        self.table.underfilled.store(0, Ordering::Relaxed);
        let address = Box::into_raw(directory) as u64;
        debug_assert!(address & 63 == 0, "the directory is 64-byte aligned");
        let old = self.table.root.load(Ordering::Relaxed);
        // Release: the directory's view words and their tables' slots before the root names
        // it.
        self.table.root.store(address, Ordering::Release);
        self.retire_word(old, guard);
    }

    /// Hands the single table a replaced root word owned (if it named one) to the epoch.
    pub(super) fn retire_word(&self, old: u64, guard: &Guard) {
        if old & 63 == 0 {
            // 0 (no table yet); a directory address is never replaced.
            return;
        }
        let old_bytes = Slots::word_bytes(old);
        // SAFETY: the root no longer names the table (readers that loaded its word are
        // pinned) and no writer touches it again; the epoch runs this once, after them, and
        // the word owned the block (`Slots::into_word`).
        unsafe { guard.defer_unchecked(move || drop(Slots::from_word(old))) };
        // As in `retire`: a large table goes to the collector now.
        if old_bytes >= FLUSH_MIN {
            guard.flush();
        }
    }

    /// Hands a replaced table (if any) to the epoch.
    pub(super) fn retire(&self, old: Shared<'_, Slots>, guard: &Guard) {
        if !old.is_null() {
            // SAFETY: `old` was this segment's table until the swap and is freed only through
            // the epoch, after `guard`.
            let old_bytes = unsafe { old.deref() }.bytes();
            // SAFETY: the old table is unreachable from the view words (readers that loaded
            // its word are pinned) and no writer touches it again; the epoch frees it after
            // them.
            unsafe { guard.defer_destroy(old) };
            // A large table goes to the collector now rather than when this thread's bag
            // fills, so memory follows the live tables; a small one waits (a flush per small
            // rebuild cost a growing table's 64 segments measurable time).
            if old_bytes >= FLUSH_MIN {
                guard.flush();
            }
        }
    }
}
