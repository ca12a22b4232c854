//! Per-entry LFU state (V3) of a partition.
//!
//! LFU state lives in a per-partition side table ([`LfuCells`]) that exists only once an entry
//! of the partition has been credited: `(digest, replica, generation) → LfuCell {count, key
//! sum}`. An LRU-only index never allocates it.
//!
//! # Creation and removal
//!
//! Readers find cells lock-free. A cell is created by an entry's first credit and killed with
//! the entry's removal, both while the partition's writer lock is held (the creator validates
//! the entry under it, and removals report their entries under it), so a cell is never created
//! for an entry already removed, and a removal finds every cell of its entry. Cells and key
//! sums are retired through the epoch.

use crate::raw::key::digest;
use crate::raw::lazy_box::LazyBox;
use crate::raw::pages::heap_chunk as chunk;
use crate::sync::{AtomicI64, AtomicPtr, AtomicU64, Mutex, Ordering};
use crossbeam_epoch::{Atomic, Guard, Owned};
use std::collections::HashMap;
// Only the std build numbers lanes with a thread-local of the seam (loom uses its own).
#[cfg(not(loom))]
use crate::sync::thread_local;
use crossbeam_utils::CachePadded;
use std::ptr::NonNull;

/// Per-entry LFU state (V3): created on the entry's first credit, killed on its removal.
///
/// # Per-core counting
///
/// The count is `access` (the *base*) plus, once the cell is hot and contended, the sum of its
/// [`Stripes`]. A credit first tries one CAS on the base. While the base is below the hot
/// threshold every credit lands there (so the key sum, which only tracks `min(count, threshold)`
/// per cell, is updated exactly); at or above the threshold a failed CAS means another core is
/// crediting the same entry at the same moment, and the credit moves to this thread's stripe
/// (a cache line of its own). A shared system prompt hit from every core therefore stops
/// bouncing one cache line after its first few credits, and nothing is merged in the
/// background: the count is summed when it is read (eviction sampling, snapshots).
///
/// No increment is lost or counted after a removal: a credit lands in the base or in a stripe
/// with a read-modify-write that refuses a [`DEAD`] value, and a kill marks the base, then the
/// stripe pointer (null → [`stripes_dead`], so no stripes appear later), then every existing
/// stripe DEAD with a `swap` that returns the stripe's final value. Every credit's RMW is
/// ordered before or after the kill's RMW on the same word: before, it is in the returned
/// total; after, it sees DEAD and is refused.
pub(crate) struct LfuCell {
    digest: u64,
    rep: u32,
    generation: u32,
    /// Base access count; [`DEAD`] once the entry was removed.
    access: AtomicU64,
    /// Null, a live [`Stripes`] (owned by this cell, freed with it) or [`stripes_dead`].
    stripes: AtomicPtr<Stripes>,
    ksum: *const KeyAccessSum,
}

/// Marks an LFU cell whose entry was removed (credits become no-ops).
pub(crate) const DEAD: u64 = 1 << 63;

/// Per-key access sum (G1 hot keys), shared by the key's LFU cells: Σ min(count, threshold).
pub(crate) struct KeyAccessSum {
    pub(crate) sum: AtomicI64,
    /// Cells pointing here (writer-side, under the cells' state lock).
    refs: AtomicI64,
}

/// Largest count a base or a stripe reaches (counts saturate, reads clamp the sum).
const COUNT_MAX: u64 = u32::MAX as u64;

/// Per-core overflow counters of a hot, contended LFU cell: one cache line per lane.
pub(crate) struct Stripes {
    lanes: Box<[CachePadded<AtomicU64>]>,
}

impl Stripes {
    fn new(lanes: usize) -> Self {
        Self {
            lanes: (0..lanes)
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
        }
    }

    /// Accounted bytes of a stripe set with `lanes` lanes.
    pub(crate) fn bytes(lanes: usize) -> usize {
        chunk(std::mem::size_of::<Self>()) + lanes * std::mem::size_of::<CachePadded<AtomicU64>>()
    }
}

/// Stripe pointer of a killed cell (never dereferenced).
#[inline]
fn stripes_dead() -> *mut Stripes {
    NonNull::<Stripes>::dangling().as_ptr()
}

/// Lanes per stripe set: the machine's parallelism rounded up to a power of two, 2..=64.
pub(crate) fn stripe_lanes() -> usize {
    #[cfg(loom)]
    {
        2
    }
    #[cfg(not(loom))]
    {
        std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .next_power_of_two()
            .clamp(2, 64)
    }
}

/// This thread's stripe lane (any value; callers mask it). Threads get consecutive lanes in the
/// order they first credit, which spreads a pool of worker threads over distinct lanes.
#[cfg(not(loom))]
fn lane_index() -> usize {
    use std::sync::atomic::AtomicUsize;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static LANE: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    LANE.with(|l| *l)
}

/// Loom build: the same first-come numbering with loom's per-execution statics, so a model's
/// lane choice is a function of its schedule (thread ids are unique across executions, so hashing
/// them would make executions diverge on replay).
#[cfg(loom)]
fn lane_index() -> usize {
    loom::lazy_static! {
        static ref NEXT: loom::sync::atomic::AtomicUsize = loom::sync::atomic::AtomicUsize::new(0);
    }
    loom::thread_local! {
        static LANE: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    LANE.with(|l| *l)
}

/// Outcome of [`LfuCell::credit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Credited {
    /// Counted while the count was below the hot threshold: the key sum gains 1.
    BelowThreshold,
    /// Counted at or above the threshold: the key sum is unchanged.
    AtOrAbove,
    /// Not counted: the entry was removed, or the count is saturated.
    Refused,
}

/// Increments `word` unless it is DEAD or saturated.
#[inline]
fn bump(word: &AtomicU64) -> bool {
    word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |x| {
        (x & DEAD == 0 && x < COUNT_MAX).then_some(x + 1)
    })
    .is_ok()
}

impl LfuCell {
    /// The key sum.
    pub(crate) fn ksum(&self) -> &KeyAccessSum {
        crate::raw::hooks::read(crate::raw::hooks::Kind::KeySum, self.ksum as usize);
        // SAFETY: a key sum is retired (through the epoch) only after every cell pointing to it
        // was unlinked, and a cell reference implies a guard pinned before that.
        unsafe { &*self.ksum }
    }

    /// Credits one access (V3). `thr` is the hot threshold (≥ 1); `cells` pays for a stripe
    /// set created here.
    pub(crate) fn credit(&self, thr: u64, lanes: usize, cells: &LfuCells) -> Credited {
        let mut v = self.access.load(Ordering::Acquire);
        loop {
            if v & DEAD != 0 || v >= COUNT_MAX {
                return Credited::Refused;
            }
            match self
                .access
                .compare_exchange_weak(v, v + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if v < thr => return Credited::BelowThreshold,
                Ok(_) => return Credited::AtOrAbove,
                // Contended at or above the threshold: count on this core's lane instead.
                Err(cur) if cur & DEAD == 0 && cur >= thr => {
                    return if self.credit_striped(lanes, cells) {
                        Credited::AtOrAbove
                    } else {
                        Credited::Refused
                    };
                }
                Err(cur) => v = cur,
            }
        }
    }

    fn credit_striped(&self, lanes: usize, cells: &LfuCells) -> bool {
        let mut s = self.stripes.load(Ordering::Acquire);
        if s.is_null() {
            let fresh = Box::into_raw(Box::new(Stripes::new(lanes)));
            match self.stripes.compare_exchange(
                std::ptr::null_mut(),
                fresh,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    cells.add_bytes(Stripes::bytes(lanes) as i64);
                    s = fresh;
                }
                Err(cur) => {
                    // SAFETY: `fresh` was never published.
                    drop(unsafe { Box::from_raw(fresh) });
                    s = cur;
                }
            }
        }
        if s == stripes_dead() {
            return false;
        }
        // SAFETY: a live stripe set is owned by the cell and freed only with it, which happens
        // through the epoch after the cell is unlinked; our guard predates that.
        let st = unsafe { &*s };
        bump(&st.lanes[lane_index() & (st.lanes.len() - 1)])
    }

    /// Adds `n` restored accesses (a checkpoint load) to the base, saturating; returns how much
    /// the key sum gains (`min(count, thr)` after minus before). Refused (0) once DEAD.
    pub(crate) fn restore(&self, n: u64, thr: u64) -> i64 {
        let mut gained = 0i64;
        let _ = self
            .access
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |x| {
                if x & DEAD != 0 {
                    return None;
                }
                let new = x.saturating_add(n).min(COUNT_MAX);
                gained = new.min(thr) as i64 - x.min(thr) as i64;
                Some(new)
            });
        gained
    }

    /// The access count: base plus stripes, clamped to `u32::MAX`.
    pub(crate) fn count(&self) -> u64 {
        let mut n = self.access.load(Ordering::Acquire) & !DEAD;
        let s = self.stripes.load(Ordering::Acquire);
        if !s.is_null() && s != stripes_dead() {
            // SAFETY: as in `credit_striped`.
            let st = unsafe { &*s };
            n += st
                .lanes
                .iter()
                .map(|l| l.load(Ordering::Acquire) & !DEAD)
                .sum::<u64>();
        }
        n.min(COUNT_MAX)
    }

    /// Marks the cell DEAD (base, stripe pointer, stripes, in that order; see the type docs).
    /// Returns `(total count, base count, stripe bytes to release)`.
    fn kill(&self) -> (u64, u64, usize) {
        let base = self.access.swap(DEAD, Ordering::AcqRel) & !DEAD;
        let mut total = base;
        let mut bytes = 0;
        if let Err(s) = self.stripes.compare_exchange(
            std::ptr::null_mut(),
            stripes_dead(),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) && s != stripes_dead()
        {
            // SAFETY: as in `credit_striped`; the stripes stay linked until the cell is freed.
            let st = unsafe { &*s };
            total += st
                .lanes
                .iter()
                .map(|l| l.swap(DEAD, Ordering::AcqRel) & !DEAD)
                .sum::<u64>();
            bytes = Stripes::bytes(st.lanes.len());
        }
        (total.min(COUNT_MAX), base, bytes)
    }
}

impl Drop for LfuCell {
    fn drop(&mut self) {
        let s = self.stripes.load(Ordering::Relaxed);
        if !s.is_null() && s != stripes_dead() {
            // SAFETY: `&mut self`: the cell is being freed (after the epoch), so no credit can
            // still reach its stripes; a live stripe set is owned by the cell.
            drop(unsafe { Box::from_raw(s) });
        }
    }
}

const LFU_CELL_BYTES: usize = 48; // chunk(size_of::<LfuCell>())

/// Open-addressing table of LFU cell pointers (null = empty, [`ltomb`] = deleted).
struct LfuTable {
    slots: Box<[AtomicPtr<LfuCell>]>,
    mask: usize,
}

#[inline]
fn ltomb() -> *mut LfuCell {
    NonNull::<LfuCell>::dangling().as_ptr()
}

/// A 64-bit finalizer (MurmurHash3's), spreading a cell's identity over the table.
#[inline]
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

#[inline]
fn lfu_hash(d: u64, rep: u32, generation: u32) -> u64 {
    mix(d ^ ((rep as u64) << 32 | generation as u64).rotate_left(17))
}

impl LfuTable {
    fn new(cap: usize) -> Self {
        Self {
            slots: (0..cap)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
            mask: cap - 1,
        }
    }
    fn bytes(&self) -> usize {
        chunk(self.slots.len() * 8) + chunk(std::mem::size_of::<Self>())
    }
    fn find(&self, d: u64, rep: u32, generation: u32) -> Option<(usize, *mut LfuCell)> {
        let mut i = lfu_hash(d, rep, generation) as usize & self.mask;
        loop {
            let c = self.slots[i].load(Ordering::Acquire);
            if c.is_null() {
                return None;
            }
            if c != ltomb() {
                crate::raw::hooks::read(crate::raw::hooks::Kind::LfuCell, c as usize);
                // SAFETY: live cell (published with Release, retired through the epoch).
                let r = unsafe { &*c };
                if r.digest == d && r.rep == rep && r.generation == generation {
                    return Some((i, c));
                }
            }
            i = (i + 1) & self.mask;
        }
    }
    fn put(&self, c: *mut LfuCell) {
        // SAFETY: `c` is a live cell owned by this table's writer.
        let r = unsafe { &*c };
        let mut i = lfu_hash(r.digest, r.rep, r.generation) as usize & self.mask;
        loop {
            let s = self.slots[i].load(Ordering::Relaxed);
            if s.is_null() || s == ltomb() {
                self.slots[i].store(c, Ordering::Release);
                return;
            }
            i = (i + 1) & self.mask;
        }
    }
}

/// Bytes a key sum costs with its map entry for a key of `len` bytes.
fn key_sum_bytes(len: usize) -> usize {
    chunk(16) + chunk(len) + 32
}

/// The writer side of [`LfuCells`], behind its lock.
#[derive(Default)]
struct CellState {
    /// Key sums by key.
    sums: HashMap<Box<[u8]>, *mut KeyAccessSum>,
    /// Live cells.
    live: usize,
    /// Table slots full or tombstoned.
    used: usize,
}

// SAFETY: the key sums `sums` points to are touched only under the state's lock or through
// atomics.
unsafe impl Send for CellState {}

/// The LFU cells of one partition (see the module docs): a table of cell pointers readers
/// probe lock-free, grown by its writers, and the key sums its cells share.
///
/// Every partition has one and most never credit an entry (LRU, or entries never hit), so a
/// partition carries only two pointers: the table's, and its writer side's ([`CellWriter`]:
/// the lock, the key sums and the byte count), made by the first
/// [`cell_or_create`](LfuCells::cell_or_create) and freed with the cells (issue 42's churned
/// tenants: 96 bytes inline, 16 with the writer side behind a pointer). The writer side is
/// published with a Release compare-exchange of its fully built box and read with Acquire, so
/// whoever sees the pointer sees the lock and the map; it is never replaced or freed before
/// the cells.
pub(crate) struct LfuCells {
    table: Atomic<LfuTable>,
    /// Null until the first cell is created.
    writer: LazyBox<CellWriter>,
}

/// The writer side of [`LfuCells`], made with its first cell.
struct CellWriter {
    state: Mutex<CellState>,
    /// Bytes of the cells, their stripes, key sums and tables, and of this record.
    bytes: AtomicI64,
}

impl Default for LfuCells {
    fn default() -> Self {
        Self::new()
    }
}

impl LfuCells {
    pub(crate) fn new() -> Self {
        Self {
            table: Atomic::null(),
            writer: LazyBox::new(),
        }
    }

    /// The writer side, if a cell was ever created.
    fn writer(&self) -> Option<&CellWriter> {
        self.writer.get()
    }

    /// The writer side, made if absent.
    fn writer_or_create(&self) -> &CellWriter {
        self.writer.get_or_make(|| CellWriter {
            state: Mutex::new(CellState::default()),
            bytes: AtomicI64::new(std::mem::size_of::<CellWriter>() as i64),
        })
    }

    /// Adds `delta` to the bytes held (a cell's stripes: its writer side exists, made with
    /// the cell, unless the cell was built outside [`LfuCells::cell_or_create`], as in tests).
    pub(crate) fn add_bytes(&self, delta: i64) {
        self.writer_or_create()
            .bytes
            .fetch_add(delta, Ordering::Relaxed);
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> i64 {
        self.writer()
            .map_or(0, |writer| writer.bytes.load(Ordering::Relaxed))
    }

    fn table<'g>(&self, guard: &'g Guard) -> Option<&'g LfuTable> {
        // SAFETY: tables are retired through the epoch; a non-null one outlives `guard`.
        unsafe { self.table.load(Ordering::Acquire, guard).as_ref() }
    }

    /// The cell of entry `(key digest, rep, generation)`, if it was ever credited and is still
    /// linked (lock-free).
    pub(crate) fn cell<'g>(
        &self,
        digest: u64,
        rep: u32,
        generation: u32,
        guard: &'g Guard,
    ) -> Option<&'g LfuCell> {
        let table = self.table(guard)?;
        // SAFETY: cells are retired through the epoch after being unlinked.
        table
            .find(digest, rep, generation)
            .map(|(_, c)| unsafe { &*c })
    }

    /// The cell of entry `(key, rep, generation)`, created (count 0) if absent. The caller
    /// holds the partition's writer lock and has found the entry live under it.
    pub(crate) fn cell_or_create<'g>(
        &self,
        key: &[u8],
        rep: u32,
        generation: u32,
        guard: &'g Guard,
    ) -> &'g LfuCell {
        let d = digest(key);
        let writer = self.writer_or_create();
        let mut st = writer.state.lock();
        if let Some(t) = self.table(guard)
            && let Some((_, c)) = t.find(d, rep, generation)
        {
            // SAFETY: live cell.
            return unsafe { &*c };
        }
        let mut added = LFU_CELL_BYTES;
        let ks = match st.sums.get(key) {
            Some(&k) => k,
            None => {
                let k = Box::into_raw(Box::new(KeyAccessSum {
                    sum: AtomicI64::new(0),
                    refs: AtomicI64::new(0),
                }));
                crate::raw::hooks::created(crate::raw::hooks::Kind::KeySum, k as usize);
                st.sums.insert(key.into(), k);
                added += key_sum_bytes(key.len());
                k
            }
        };
        // SAFETY: `ks` is linked in `sums` (mutated under the state lock, which we hold).
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
        // Grow or create the table (load ≤ 1/2, tombstones included).
        let cap = self.table(guard).map_or(0, |t| t.slots.len());
        if (st.used + 1) * 2 > cap {
            let old = self.table.load(Ordering::Acquire, guard);
            let fresh = LfuTable::new(((st.live + 1) * 4).next_power_of_two().max(16));
            let mut delta = fresh.bytes() as i64;
            // SAFETY: `old` is null or the live table (we hold the state lock).
            if let Some(old) = unsafe { old.as_ref() } {
                delta -= old.bytes() as i64;
                for s in old.slots.iter() {
                    let c = s.load(Ordering::Relaxed);
                    if !c.is_null() && c != ltomb() {
                        fresh.put(c);
                    }
                }
            }
            self.add_bytes(delta);
            self.table.store(Owned::new(fresh), Ordering::Release);
            if !old.is_null() {
                // SAFETY: unlinked; dropping an `LfuTable` frees only its slot array.
                unsafe { guard.defer_destroy(old) };
            }
            st.used = st.live;
        }
        if let Some(t) = self.table(guard) {
            t.put(cell);
        }
        st.live += 1;
        st.used += 1;
        self.add_bytes(added as i64);
        // SAFETY: just linked; retired only through the epoch.
        unsafe { &*cell }
    }

    /// Kills the cell of a removed entry, if any: marks it DEAD, unlinks it and returns
    /// `(base count, key sum)` so the caller can take the cell's contribution,
    /// `min(base, threshold)`, back out of the key sum (see [`LfuCell`]). The caller holds
    /// the partition's writer lock.
    pub(crate) fn kill<'g>(
        &self,
        key: &[u8],
        rep: u32,
        generation: u32,
        guard: &'g Guard,
    ) -> Option<(u64, &'g KeyAccessSum)> {
        let writer = self.writer()?;
        let mut st = writer.state.lock();
        let t = self.table(guard)?;
        let (i, c) = t.find(digest(key), rep, generation)?;
        t.slots[i].store(ltomb(), Ordering::Release);
        st.live -= 1;
        // SAFETY: the cell was live and is now unlinked; readers may still hold it.
        let cell = unsafe { &*c };
        let (_, base, stripe_bytes) = cell.kill();
        let ks = cell.ksum;
        let mut freed = (LFU_CELL_BYTES + stripe_bytes) as i64;
        // SAFETY: `ks` is linked in `sums` while its refs are above 0.
        if unsafe { (*ks).refs.fetch_sub(1, Ordering::Relaxed) } == 1 {
            st.sums.remove(key);
            freed += key_sum_bytes(key.len()) as i64;
            let kp = ks as usize;
            // SAFETY: the key sum is unlinked from `sums` and no live cell points to it;
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
}

impl Drop for LfuCells {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: nothing else can reach these cells; the ones still linked are
        // owned here (retired ones belong to the epoch collector).
        unsafe {
            let guard = crossbeam_epoch::unprotected();
            let table = self.table.load(Ordering::Relaxed, guard);
            if !table.is_null() {
                let table = table.into_owned();
                for s in table.slots.iter() {
                    let c = s.load(Ordering::Relaxed);
                    if !c.is_null() && c != ltomb() {
                        crate::raw::hooks::destroyed(crate::raw::hooks::Kind::LfuCell, c as usize);
                        drop(Box::from_raw(c));
                    }
                }
            }
            // The writer side itself is freed with its `LazyBox`; its key sums are freed here.
            if let Some(writer) = self.writer.get_mut() {
                for (_, k) in writer.state.get_mut().sums.drain() {
                    crate::raw::hooks::destroyed(crate::raw::hooks::Kind::KeySum, k as usize);
                    drop(Box::from_raw(k));
                }
            }
        }
    }
}

// SAFETY: `LfuCell::ksum` points to a key sum accessed only through atomics and freed through the
// epoch collector.
unsafe impl Send for LfuCell {}
// SAFETY: see `Send`.
unsafe impl Sync for LfuCell {}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn cell(ksum: &KeyAccessSum) -> LfuCell {
        LfuCell {
            digest: 1,
            rep: 0,
            generation: 1,
            access: AtomicU64::new(0),
            stripes: AtomicPtr::new(std::ptr::null_mut()),
            ksum,
        }
    }

    fn key_sum() -> KeyAccessSum {
        KeyAccessSum {
            sum: AtomicI64::new(0),
            refs: AtomicI64::new(0),
        }
    }

    #[test]
    fn credits_below_the_threshold_land_in_the_base() {
        let (t, ks) = (LfuCells::new(), key_sum());
        let c = cell(&ks);
        let got: Vec<_> = (0..4).map(|_| c.credit(2, 4, &t)).collect();
        assert_eq!(
            got,
            [
                Credited::BelowThreshold,
                Credited::BelowThreshold,
                Credited::AtOrAbove,
                Credited::AtOrAbove
            ]
        );
        assert_eq!(c.count(), 4);
        assert!(c.stripes.load(Ordering::Relaxed).is_null());
    }

    #[test]
    fn stripes_add_to_the_count_and_die_with_the_cell() {
        let (t, ks) = (LfuCells::new(), key_sum());
        assert_eq!(t.bytes(), 0, "no writer side before a cell");
        // The stripes' bytes make the writer side (a cell built outside `cell_or_create`),
        // which counts itself.
        let bytes0 = std::mem::size_of::<CellWriter>() as i64;
        let c = cell(&ks);
        for _ in 0..3 {
            c.credit(2, 4, &t);
        }
        for _ in 0..5 {
            assert!(c.credit_striped(4, &t));
        }
        assert_eq!(c.count(), 8);
        assert_eq!(t.bytes() - bytes0, Stripes::bytes(4) as i64);
        let (total, base, stripe_bytes) = c.kill();
        assert_eq!((total, base, stripe_bytes), (8, 3, Stripes::bytes(4)));
        assert_eq!(c.credit(2, 4, &t), Credited::Refused);
        assert!(!c.credit_striped(4, &t), "a dead stripe refuses credits");
        assert_eq!(c.count(), 0, "a dead cell's words are all DEAD (count 0)");
    }

    #[test]
    fn a_killed_cell_never_grows_stripes() {
        let (t, ks) = (LfuCells::new(), key_sum());
        let c = cell(&ks);
        for _ in 0..3 {
            c.credit(2, 4, &t);
        }
        assert_eq!(c.kill(), (3, 3, 0));
        let bytes = t.bytes();
        assert!(!c.credit_striped(4, &t));
        assert_eq!(c.stripes.load(Ordering::Relaxed), stripes_dead());
        assert_eq!(t.bytes(), bytes, "no stripe set was created");
    }

    #[test]
    fn counts_saturate_at_u32_max() {
        let (t, ks) = (LfuCells::new(), key_sum());
        let c = cell(&ks);
        c.access.store(COUNT_MAX - 1, Ordering::Relaxed);
        assert_eq!(c.credit(2, 4, &t), Credited::AtOrAbove);
        assert_eq!(c.credit(2, 4, &t), Credited::Refused);
        assert!(c.credit_striped(4, &t));
        assert_eq!(c.count(), COUNT_MAX, "the sum is clamped");
    }
}
