//! Exclusive writer access to one shard of a key table: inserts, replacements, removals,
//! rebuilds and the LFU kills, under the shard mutex (invariant 3 of `table.rs`), publishing
//! with the stores its memory-ordering section describes.

use super::lfu::{KeyAccessSum, LFU_CELL_BYTES, LfuCell, LfuTable, ltomb};
use super::node::{GEN_MASK, Holder, KeyNode, digest};
use super::table::{
    COMPACT_SLACK, Compact, EMPTY, KeyTable, LO, MIN_GROUPS, NARROW_LANES, Probe, Shard,
    ShardState, ShardTable, TOMB, WIDE_LANES, empty_table, fingerprint, is_shared_empty, mix,
    note_retired, prefetch, table_bytes, zero_bytes,
};
use crate::raw::arena::{Arena, ArenaState, BATCH_CAPACITY};
use crate::raw::hooks;
use crate::raw::pages::heap_chunk as chunk;
use crate::raw::runs::ChainRun;
use crate::sync::{AtomicI64, AtomicPtr, AtomicU64, MutexGuard, Ordering};
use crossbeam_epoch::{Guard, Owned, Shared};
use std::ptr::NonNull;
use std::sync::Arc;

/// Exclusive writer access to one shard.
pub(crate) struct ShardWriter<'a> {
    pub(super) shard: &'a Shard,
    pub(super) table: &'a KeyTable,
    pub(super) st: MutexGuard<'a, ShardState>,
}

/// Slot index encoding for writers: `group << 3 | lane` (lanes 6 and 7 of a wide group never
/// hold a key).
#[inline]
fn slot_id(g: usize, lane: usize) -> usize {
    g << 3 | lane
}

impl ShardWriter<'_> {
    /// Adds to the shard's byte count (mutex holder only: load + store, no RMW).
    #[inline]
    fn add_bytes(&self, d: i64) {
        let b = &self.shard.bytes;
        b.store(b.load(Ordering::Relaxed) + d, Ordering::Relaxed);
    }

    fn current<'g>(&self, guard: &'g Guard) -> &'g ShardTable {
        // SAFETY: non-null (see `KeyTable::table_of`); only we (mutex holder) replace it, and
        // the old one is retired through the epoch.
        unsafe { self.shard.table.load(Ordering::Acquire, guard).deref() }
    }

    /// Finds the key of a prepared probe (which must belong to this shard): its slot id and node.
    pub(crate) fn find_p<'g>(
        &self,
        p: Probe<'_>,
        guard: &'g Guard,
    ) -> Option<(usize, &'g KeyNode)> {
        let t = self.current(guard);
        // SAFETY: live node, see `ShardTable::probe`.
        t.probe(p.key, p.d, p.h)
            .map(|(g, l, n)| (slot_id(g, l), unsafe { &*n }))
    }

    /// Number of slot ids of the current table (for sliced walks).
    pub(crate) fn capacity(&self, guard: &Guard) -> usize {
        self.current(guard).groups.len() << 3
    }

    /// Counter bumped by every rebuild (a sliced walk restarts when it changes).
    pub(crate) fn rebuilds(&self) -> u64 {
        self.st.rebuilds
    }

    /// The live node at slot id `i`, if any.
    pub(crate) fn node_at<'g>(&self, i: usize, guard: &'g Guard) -> Option<&'g KeyNode> {
        let t = self.current(guard);
        let i = t.lane_at(i)?;
        if i == 0 {
            None
        } else {
            // SAFETY: live node, see `ShardTable::probe`.
            Some(unsafe { &*(t.arena.node(i) as *const KeyNode) })
        }
    }

    /// A fresh per-entry generation.
    pub(crate) fn next_generation(&mut self) -> u32 {
        let g = self.st.next_gen & GEN_MASK;
        self.st.next_gen = self.st.next_gen.wrapping_add(1);
        g
    }

    /// Replaces the node at slot id `i` (same key) with a node built from `holders` (naming
    /// `run`'s offset, see [`crate::raw::runs`]); retires the old node. Returns the new node.
    pub(crate) fn replace(
        &mut self,
        i: usize,
        holders: &[Holder],
        run: Option<u64>,
        guard: &Guard,
    ) -> *const KeyNode {
        let t = self.current(guard);
        let old = t.lane_at(i).unwrap_or(0);
        debug_assert!(old != 0);
        let old_node = t.arena.node(old) as *const KeyNode;
        // SAFETY: `old` is live (we hold the shard mutex; only we unlink), and stays so until
        // it is retired below, in this arena (a rebuild inside `build` never compacts).
        let (key, d, old_run) =
            unsafe { ((*old_node).key(), (*old_node).digest(), (*old_node).run()) };
        let rebuilds = self.st.rebuilds;
        let (new, nn) = self.build(key, d, holders, run, guard);
        let t = self.current(guard);
        let (g, l) = if self.st.rebuilds == rebuilds {
            (i >> 3, i & 7)
        } else {
            // `build` moved the shard to a wide table, and the key with it.
            match t.probe(key, d, mix(d)) {
                Some((g, l, _)) => (g, l),
                None => unreachable!("a rebuild moves every live key"),
            }
        };
        let tag = (t.read(g, Ordering::Relaxed).tags >> (8 * l)) & 0xff;
        Self::unlink_run(old_run);
        t.set(g, l, tag, new, Ordering::Release);
        self.retire_node(old, guard);
        self.release_run(old_run, guard);
        nn.as_ptr()
    }

    /// Before an unlinked node's replacement is published: its run no longer covers it.
    #[inline]
    fn unlink_run(run: Option<(*const ChainRun, usize)>) {
        if let Some((r, o)) = run {
            // SAFETY: the node naming the run is still linked, so the run is alive.
            unsafe { (*r).unlink(o) };
        }
    }

    /// After an unlinked node's replacement is published: drops the node's run reference.
    #[inline]
    fn release_run(&self, run: Option<(*const ChainRun, usize)>, guard: &Guard) {
        if let Some((r, _)) = run {
            // SAFETY: the node owned this reference and is unlinked now.
            let freed = unsafe { ChainRun::release(r, &self.table.reaper, guard) };
            if freed != 0 {
                self.table.add_run_bytes(-(freed as i64));
            }
        }
    }

    /// Builds a node in this shard's arena (accounting any memory the arena had to take).
    fn build(
        &mut self,
        key: &[u8],
        d: u64,
        holders: &[Holder],
        run: Option<u64>,
        guard: &Guard,
    ) -> (u32, NonNull<KeyNode>) {
        if is_shared_empty(self.current(guard)) {
            // An emptied shard's first new node: a table and arena of its own first.
            self.rebuild(guard, Compact::Never);
        }
        let t = self.current(guard);
        let before = self.st.arena.bytes();
        let built = KeyNode::build_in(&mut self.st.arena, &t.arena, key, d, holders, run, guard);
        self.add_bytes(self.st.arena.bytes() - before);
        self.st.node_units += KeyNode::units_of(holders, key, run) as usize;
        self.st.peak_units = self.st.peak_units.max(self.st.node_units);
        if !t.wide && u64::from(built.0) >= self.st.narrow_limit {
            // A narrow lane cannot name the new node: move the shard to a wide table first
            // (the node is not published yet; the rebuild keeps this arena).
            self.rebuild(guard, Compact::Never);
        }
        built
    }

    fn retire_node(&mut self, old: u32, guard: &Guard) {
        note_retired(guard);
        let t = self.current(guard);
        // SAFETY: `old` is a live node of this shard (we hold its mutex).
        let units = unsafe { (*(t.arena.node(old) as *const KeyNode)).units() };
        self.st.node_units -= units as usize;
        let st = &mut *self.st;
        let batch = st
            .retired
            .get_or_insert_with(|| st.arena.new_batch(&t.arena));
        t.arena.add_retired(batch, old, units);
        if batch.len() >= BATCH_CAPACITY {
            self.flush_retired(guard);
        }
    }

    /// Hands the session's unlinked nodes to the epoch.
    fn flush_retired(&mut self, guard: &Guard) {
        let Some(batch) = self.st.retired.take() else {
            return;
        };
        // SAFETY: every node in the batch was a live node of the current table's arena (a
        // compaction flushes first) and is now unlinked from the current table (and from any
        // older table by construction: rebuilds move indices, and older tables are retired);
        // readers pinned before the unlink may still read it, so the arena takes it back only
        // through the epoch — deferring later than the unlink only delays that. Retired once:
        // only the mutex holder unlinks, and the batch is taken out of the state.
        unsafe { self.current(guard).arena.retire_batch(batch, guard) };
    }

    /// Deletes the key at slot id `i` (tombstone) and retires its node.
    pub(crate) fn remove(&mut self, i: usize, guard: &Guard) {
        let t = self.current(guard);
        let (g, lane) = (i >> 3, i & 7);
        let grp = t.read(g, Ordering::Relaxed);
        let old = grp.idx(lane);
        debug_assert!(old != 0);
        // Invariant 2: a group that still has an EMPTY lane has had one since the table was
        // built, so no probe ever went past it and no key lives beyond it; the freed lane can be
        // EMPTY again (probes keep ending here). Otherwise it must stay a tombstone.
        let freed = if zero_bytes(grp.tags) != 0 {
            self.st.used -= 1;
            EMPTY
        } else {
            TOMB
        };
        // SAFETY: `old` is live until retired below (we hold the mutex).
        let old_run = unsafe { (*(t.arena.node(old) as *const KeyNode)).run() };
        Self::unlink_run(old_run);
        t.set(g, lane, freed, 0, Ordering::Release);
        self.retire_node(old, guard);
        self.release_run(old_run, guard);
        self.st.live -= 1;
    }

    /// Shrinks the table when it is mostly empty (call outside sliced walks).
    /// Also compacts an arena holding more than 1.5× the most node bytes ever live at once
    /// since it was created (+ 16 KiB): under steady churn that excess is garbage that waited
    /// for its epoch, and without this the arena's high-water mark ratchets up with every burst.
    /// Measured against the peak, not the current live bytes, so a shard that is merely
    /// shrinking is left to the 4× bar of its shrink rebuilds (against the live bytes, a shard
    /// emptied key by key copied its nodes once per halving, which cost W1M's removal a third
    /// of its speed).
    pub(crate) fn maybe_shrink(&mut self, guard: &Guard) {
        let t = self.current(guard);
        let held = self.st.arena.carved();
        // An empty shard gives back its table and arena.
        let empty_arena = self.st.live == 0 && (held > 0 || !is_shared_empty(t));
        let peak_bytes = (self.st.peak_units * crate::raw::arena::UNIT) as i64;
        let bloated = held > peak_bytes * 3 / 2 + COMPACT_SLACK;
        if t.groups.len() > MIN_GROUPS && self.st.live * 8 < t.slots() || empty_arena || bloated {
            self.rebuild(
                guard,
                if bloated {
                    Compact::Force
                } else {
                    Compact::Auto
                },
            );
        }
    }

    /// Inserts a new key (the caller checked it is absent) with `holders` (naming `run`'s
    /// offset); `p` must belong to this shard. Returns the new node.
    pub(crate) fn insert_p(
        &mut self,
        p: Probe<'_>,
        holders: &[Holder],
        run: Option<u64>,
        guard: &Guard,
    ) -> *const KeyNode {
        if (self.st.used + 1) * 20 > self.current(guard).slots() * 17 {
            self.rebuild(guard, Compact::Auto);
        }
        let (node, nn) = self.build(p.key, p.d, holders, run, guard);
        let t = self.current(guard);
        // Summary bit before the node is published (a reader that sees the node's tag and
        // pointer with Acquire also sees the bit; a reader that misses the bit is concurrent).
        t.mark(p.h);
        let mut g = t.home(p.h);
        let real = t.lane_bytes();
        loop {
            let tags = t.read(g, Ordering::Relaxed).tags;
            // Free lanes: EMPTY (0) or TOMB (1), i.e. bytes ≤ 1.
            let free = zero_bytes((tags & !LO & real) | !real);
            if free != 0 {
                let lane = (free.trailing_zeros() / 8) as usize;
                debug_assert!(lane < t.lanes());
                if (tags >> (8 * lane)) & 0xff == EMPTY {
                    self.st.used += 1;
                }
                t.set(g, lane, fingerprint(p.h), node, Ordering::Release);
                break;
            }
            g = t.step(g);
        }
        self.st.live += 1;
        nn.as_ptr()
    }

    /// Rebuilds the table sized for the live keys (drops tombstones, grows or shrinks). When
    /// `compact` is asked (`maybe_shrink`'s bloat check), the arena holds more than four times
    /// the live nodes' bytes (+ 16 KiB: a shard emptied key by key then copies each node about
    /// 1/3 of a time in all) or the shard is empty, the live nodes are also copied into a fresh
    /// arena and the old one goes with the old table, through the epoch.
    fn rebuild(&mut self, guard: &Guard, compact: Compact) {
        self.rebuild_for(guard, compact, 0);
    }

    /// Sizes the table for `keys` live keys (at load 1/2) unless it already has that room: a
    /// checkpoint load presizes each shard, because it inserts keys in the order of another
    /// table, i.e. by ascending home position, which in a smaller table would all crowd into
    /// its first groups and probe past each other (quadratic) until the table grew.
    pub(crate) fn reserve(&mut self, keys: usize, guard: &Guard) {
        if keys.saturating_mul(2) > self.current(guard).slots() {
            self.rebuild_for(guard, Compact::Never, keys);
        }
    }

    /// [`ShardWriter::rebuild`], sized for at least `min_keys` live keys.
    fn rebuild_for(&mut self, guard: &Guard, compact: Compact, min_keys: usize) {
        // Retirements belong to the current arena, which a compaction replaces.
        self.flush_retired(guard);
        let old_shared = self.shard.table.load(Ordering::Acquire, guard);
        // SAFETY: non-null, see `current`.
        let old = unsafe { old_shared.deref() };
        let from_shared = is_shared_empty(old);
        // Rebuilt at 17/20 of the slots used (live or tombstone), shrunk below 1/8 live, with no
        // power-of-two rounding. Growth (a quarter more live keys than at the last rebuild):
        // load 1/2 after the rebuild, so a growing table is rebuilt every ×1.7 (each key moved
        // ~2.4 times in all). Otherwise the rebuild mostly drops tombstones (steady churn at the
        // cap) or shrinks: load 2/3, so a table of constant size holds 1.5 slots per key, not
        // 2, and is rebuilt again after a fifth of its slots have turned into tombstones.
        let live = (self.st.live + 1).max(min_keys);
        let growing = min_keys > 0 || live * 4 > self.st.live_at_rebuild * 5;
        self.st.live_at_rebuild = live;
        let slots = if growing { live * 2 } else { live * 3 / 2 };
        let live_bytes = (self.st.node_units * crate::raw::arena::UNIT) as i64;
        let held = self.st.arena.carved();
        let compact = !from_shared
            && match compact {
                Compact::Never => false,
                Compact::Force => true,
                Compact::Auto => {
                    held > 4 * live_bytes + COMPACT_SLACK || self.st.live == 0 && held > 0
                }
            };
        // Narrow lanes while every index of the table's arena is below the limit (24 bits):
        // the arena's chunk ids so far. Moving nodes keeps the arena, so the width is known
        // now. A compaction decides it from the fresh arena's chunk ids once the live nodes
        // are copied (their places are kept until then): an estimate from the live bytes
        // alone missed the ids a fresh arena's small first chunks take, so a compacted shard
        // could get a width its next rebuild undid (narrow, then wide again with no node
        // added), or a wide table it did not need.
        let limit = self.st.narrow_limit;
        let groups_for = |wide: bool| {
            slots
                .div_ceil(if wide { WIDE_LANES } else { NARROW_LANES })
                .max(MIN_GROUPS)
        };
        // A shard left empty by a compaction keeps no table: it goes back to the shared empty
        // table readers of an uncreated shard probe (an empty-but-live partition then holds its
        // shard's shell only).
        if compact && self.st.live == 0 && min_keys == 0 {
            let held_before = table_bytes(old) as i64 + self.st.arena.bytes();
            self.add_bytes(-held_before);
            self.st.arena = ArenaState::new();
            self.st.peak_units = 0;
            self.publish(
                old_shared,
                Shared::from(empty_table() as *const ShardTable),
                guard,
            );
            return;
        }
        let mut fresh = compact.then(ArenaState::new);
        // The nodes a compaction copies (tracked builds only: their old copies end with the
        // old table, after the epoch).
        let mut moved_from: Vec<usize> = Vec::new();
        // The shared empty table's arena is never written: leaving it takes a fresh one (the
        // shard's arena state was reset when it moved onto the shared table).
        let new_arena = if compact || from_shared {
            Arc::new(Arena::new())
        } else {
            old.arena.clone()
        };
        let moved_into = (!compact).then(|| {
            let wide = self.st.arena.index_bound() > limit;
            ShardTable::new(groups_for(wide), new_arena.clone(), wide)
        });
        let mut copied: Vec<(u64, u32)> = Vec::new();
        let arena = &old.arena;
        for gi in 0..old.groups.len() {
            // Each move reads the node's digest: prefetch the nodes of a group 4 ahead, and the
            // run keys (a run node's key lives in its run) of the group 2 ahead, whose nodes
            // were prefetched two steps earlier.
            if gi + 4 < old.groups.len() {
                let ahead = old.read(gi + 4, Ordering::Relaxed);
                for l in 0..old.lanes() {
                    let n = ahead.idx(l);
                    if n != 0 {
                        prefetch(arena.node(n));
                    }
                }
            }
            if gi + 2 < old.groups.len() {
                let next = old.read(gi + 2, Ordering::Relaxed);
                for l in 0..old.lanes() {
                    let n = next.idx(l);
                    if n == 0 {
                        continue;
                    }
                    // SAFETY: live node (we hold the mutex).
                    let run = unsafe { (*(arena.node(n) as *const KeyNode)).run() };
                    if let Some((r, o)) = run {
                        // SAFETY: a linked node's run is alive (see `KeyNode::run`).
                        prefetch(unsafe { (*r).key_bytes(o) });
                    }
                }
            }
            let grp = old.read(gi, Ordering::Relaxed);
            for l in 0..old.lanes() {
                let n = grp.idx(l);
                if n == 0 {
                    continue;
                }
                let node = arena.node(n) as *const KeyNode;
                // SAFETY: live node (we hold the mutex).
                let h = mix(unsafe { (*node).digest() });
                let n = match fresh.as_mut() {
                    Some(st) => {
                        // SAFETY: live node (we hold the mutex).
                        let units = unsafe { (*node).units() };
                        let (i, p) = st.alloc(&new_arena, units, guard);
                        // SAFETY: `p` has room for `units` units and is not yet published;
                        // `node` stays valid (its arena lives until the old table is freed).
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                node as *const u8,
                                p,
                                units as usize * crate::raw::arena::UNIT,
                            )
                        };
                        hooks::created(hooks::Kind::Node, p as usize);
                        if hooks::TRACKS_OBJECTS {
                            moved_from.push(node as usize);
                        }
                        i
                    }
                    None => n,
                };
                match &moved_into {
                    Some(new) => new.place(h, n),
                    None => copied.push((h, n)),
                }
            }
        }
        let new = match (moved_into, &fresh) {
            (Some(new), _) => new,
            (None, Some(st)) => {
                let wide = st.index_bound() > limit;
                let new = ShardTable::new(groups_for(wide), new_arena, wide);
                for (h, n) in copied {
                    new.place(h, n);
                }
                new
            }
            (None, None) => unreachable!("a rebuild either moves or compacts"),
        };
        let mut delta = new.bytes() as i64 - table_bytes(old) as i64;
        if let Some(st) = fresh {
            // The old arena's memory goes back when the old table (and every pending deferred
            // free into it) is gone.
            delta += st.bytes() - self.st.arena.bytes();
            self.st.arena = st;
            self.st.peak_units = self.st.node_units;
        }
        self.add_bytes(delta);
        hooks::destroyed_after_epoch(hooks::Kind::Node, moved_from, guard);
        self.publish(old_shared, Owned::new(new).into_shared(guard), guard);
    }

    /// Publishes `new` as the shard's table and retires `old` (unless it is the shared empty
    /// table, which is never freed).
    fn publish<'g>(
        &mut self,
        old: Shared<'g, ShardTable>,
        new: Shared<'g, ShardTable>,
        guard: &'g Guard,
    ) {
        // Release: publishes the fully built table.
        self.shard.table.store(new, Ordering::Release);
        // SAFETY: `old` is non-null (see `current`).
        if !is_shared_empty(unsafe { old.deref() }) {
            // SAFETY: the old table is unlinked; pinned readers may still probe it. Dropping a
            // `ShardTable` frees its group array and its reference to the arena: the nodes
            // (moved or copied) are never freed with it, and a replaced arena is freed by its
            // last reference.
            unsafe { guard.defer_destroy(old) };
        }
        self.st.used = self.st.live;
        self.st.rebuilds += 1;
    }

    // ---- LFU side table ----------------------------------------------------------------------

    fn lfu_table<'g>(&self, guard: &'g Guard) -> Option<&'g LfuTable> {
        // SAFETY: see `KeyTable::lfu_cell`.
        unsafe { self.shard.lfu.load(Ordering::Acquire, guard).as_ref() }
    }

    /// The LFU cell of an entry, creating it (count 0) if absent. The caller has validated,
    /// under this writer, that the entry `(key, rep, generation)` is live.
    pub(crate) fn lfu_cell_or_create<'g>(
        &mut self,
        key: &[u8],
        rep: u32,
        generation: u32,
        guard: &'g Guard,
    ) -> &'g LfuCell {
        let d = digest(key);
        if let Some(t) = self.lfu_table(guard)
            && let Some((_, c)) = t.find(d, rep, generation)
        {
            // SAFETY: live cell.
            return unsafe { &*c };
        }
        // Key sum.
        let mut added = 0usize;
        let ksums = self.st.ksums.get_or_insert_with(Box::default);
        let ks = match ksums.get(key) {
            Some(&k) => k,
            None => {
                let k = Box::into_raw(Box::new(KeyAccessSum {
                    sum: AtomicI64::new(0),
                    refs: AtomicI64::new(0),
                }));
                crate::raw::hooks::created(crate::raw::hooks::Kind::KeySum, k as usize);
                ksums.insert(key.into(), k);
                added += chunk(16) + chunk(key.len()) + 32;
                k
            }
        };
        // SAFETY: `ks` is linked in `ksums` (owned by this shard, mutated under the mutex).
        unsafe { (*ks).refs.fetch_add(1, Ordering::Relaxed) };
        let cell = Box::into_raw(Box::new(LfuCell {
            digest: d,
            rep,
            generation,
            access: AtomicU64::new(0),
            stripes: AtomicPtr::new(std::ptr::null_mut()),
            ksum: ks,
        }));
        crate::raw::hooks::created(crate::raw::hooks::Kind::LfuCell, cell as usize);
        added += LFU_CELL_BYTES;
        // Grow / create the table (load ≤ 1/2 including tombstones).
        let cap = self.lfu_table(guard).map_or(0, |t| t.slots.len());
        if (self.st.lfu_used + 1) * 2 > cap {
            let old = self.shard.lfu.load(Ordering::Acquire, guard);
            let ncap = ((self.st.lfu_live + 1) * 4).next_power_of_two().max(16);
            let nt = LfuTable::new(ncap);
            let mut delta = nt.bytes() as i64;
            // SAFETY: `old` is null or a live table (we hold the mutex).
            if let Some(ot) = unsafe { old.as_ref() } {
                delta -= ot.bytes() as i64;
                for s in ot.slots.iter() {
                    let c = s.load(Ordering::Relaxed);
                    if !c.is_null() && c != ltomb() {
                        nt.put(c);
                    }
                }
            }
            self.add_bytes(delta);
            self.shard.lfu.store(Owned::new(nt), Ordering::Release);
            if !old.is_null() {
                // SAFETY: unlinked; dropping an `LfuTable` frees only its slot array.
                unsafe { guard.defer_destroy(old) };
            }
            self.st.lfu_used = self.st.lfu_live;
        }
        self.lfu_table(guard).expect("lfu table").put(cell);
        self.st.lfu_live += 1;
        self.st.lfu_used += 1;
        self.add_bytes(added as i64);
        // SAFETY: just linked; retired only through the epoch.
        unsafe { &*cell }
    }

    /// Kills the LFU cell of a removed entry, if any: marks it DEAD, unlinks it and returns
    /// `(base count, key sum)` so the caller can take the cell's contribution,
    /// `min(base, threshold)`, back out of the key sum (see [`LfuCell`]).
    pub(crate) fn lfu_kill<'g>(
        &mut self,
        key: &[u8],
        rep: u32,
        generation: u32,
        guard: &'g Guard,
    ) -> Option<(u64, &'g KeyAccessSum)> {
        let t = self.lfu_table(guard)?;
        let (i, c) = t.find(digest(key), rep, generation)?;
        t.slots[i].store(ltomb(), Ordering::Release);
        self.st.lfu_live -= 1;
        // SAFETY: the cell was live and is now unlinked; readers may still hold it.
        let cell = unsafe { &*c };
        let (_, base, stripe_bytes) = cell.kill();
        let ks = cell.ksum;
        let mut freed = (LFU_CELL_BYTES + stripe_bytes) as i64;
        // SAFETY: `ks` is linked in `ksums` while refs > 0.
        if unsafe { (*ks).refs.fetch_sub(1, Ordering::Relaxed) } == 1 {
            if let Some(ksums) = self.st.ksums.as_mut() {
                ksums.remove(key);
            }
            freed += (chunk(16) + chunk(key.len()) + 32) as i64;
            let kp = ks as usize;
            // SAFETY: the key sum is unlinked from `ksums` and no live cell points to it;
            // readers that loaded it earlier are pinned, so it is freed through the epoch.
            unsafe {
                guard.defer_unchecked(move || {
                    crate::raw::hooks::destroyed(crate::raw::hooks::Kind::KeySum, kp);
                    drop(Box::from_raw(kp as *mut KeyAccessSum))
                })
            };
        }
        let cp = c as usize;
        // SAFETY: unlinked above; freed through the epoch.
        unsafe {
            guard.defer_unchecked(move || {
                crate::raw::hooks::destroyed(crate::raw::hooks::Kind::LfuCell, cp);
                drop(Box::from_raw(cp as *mut LfuCell))
            })
        };
        self.add_bytes(-freed);
        // SAFETY: retired through the epoch, valid for `guard`.
        Some((base, unsafe { &*ks }))
    }

    /// Whether this shard has any LFU cell (an LRU-only shard skips the kill lookup).
    #[inline]
    pub(crate) fn has_lfu(&self) -> bool {
        self.st.lfu_live > 0
    }
}
