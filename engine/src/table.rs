//! The per-partition key table: a sharded open-addressing hash table of immutable key nodes.
//!
//! # Layout
//!
//! A [`KeyTable`] has [`SHARDS`] shards chosen by the top bits of the mixed key digest. Each shard
//! owns an epoch-protected [`ShardTable`] (a power-of-two array of [`Slot`]s, linear probing) and a
//! writer mutex. A slot is `{digest: AtomicU64, node: AtomicPtr<KeyNode>}`; `node` is null (never
//! used: ends a probe), [`tomb()`] (deleted: probe continues) or a live [`KeyNode`].
//!
//! # Invariants
//!
//! 1. A slot's `digest` is written once, before the slot's first node is published, and never
//!    changes afterwards (tombstoned slots are not reused; they disappear at the next rebuild).
//! 2. A published [`KeyNode`] is immutable. Every change to a key's holders builds a new node and
//!    swaps the slot pointer (Release); the old node is retired through the epoch collector.
//! 3. Every table has at least one null slot (load, tombstones included, stays ≤ 3/4), so a probe
//!    terminates.
//! 4. Only the holder of the shard mutex stores into a shard's slots or table pointer.
//! 5. Nodes, entry cells and key cells are freed only through `Guard::defer*` after being made
//!    unreachable from the current table, so a reader pinned before the unlink can still read them.
//!
//! # Memory ordering
//!
//! Writers publish a node with a `Release` store into `slot.node` after initializing it (and, for
//! a fresh slot, after the `Relaxed` store of `digest`). Readers load `slot.node` with `Acquire`,
//! which makes the node's contents and the slot's digest visible: a reader therefore sees a whole
//! node (C3, never torn). A rebuilt table is published with a `Release` store of the shard's table
//! pointer and read with `Acquire`; readers that still hold the old table see nodes that are valid
//! until their guard is dropped (stale but consistent).

use crate::sync::{AtomicI64, AtomicPtr, AtomicU64, Ordering};
use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned, Shared};
use crossbeam_utils::CachePadded;
use parking_lot::{Mutex, MutexGuard};
use std::ptr::NonNull;

/// Number of shards per partition table.
pub(crate) const SHARDS: usize = 16;
const SHARD_SHIFT: u32 = 60;
/// Minimum slots per shard table.
pub(crate) const MIN_CAP: usize = 8;
/// Estimated allocator overhead per allocation, for memory accounting.
pub(crate) const ALLOC_OVERHEAD: usize = 16;

/// Tier codes as stored (K6 compaction): 1 = T1, 2 = T2, 3 = T3, 4 = colder/invalid.
pub(crate) const TIER_COLDER: u8 = 4;
const TIER_SHIFT: u32 = 29;
/// Largest scope-local replica index.
pub(crate) const REP_MASK: u32 = (1 << TIER_SHIFT) - 1;

/// Wire → stored tier (K6).
#[inline]
pub(crate) fn tier_code(wire: i32) -> u8 {
    match wire {
        0 => 1,
        1..=3 => wire as u8,
        _ => TIER_COLDER,
    }
}

/// Stored → wire tier (K6).
#[inline]
pub(crate) fn tier_wire(code: u8) -> i32 {
    if (1..=3).contains(&code) {
        code as i32
    } else {
        0
    }
}

/// Per storage entry LFU state, shared by every version of the entry's key node (V3). `generation` is
/// unique per entry creation, so a captured hit can never credit a different entry (L9, T92).
pub(crate) struct EntryCell {
    pub(crate) generation: u64,
    /// Access count; [`DEAD`] set once the entry is removed.
    pub(crate) access: AtomicU64,
}

/// Marks an entry cell whose entry was removed (credits become no-ops).
pub(crate) const DEAD: u64 = 1 << 63;

/// Per key state shared by every version of the key's node: the sum of its holders' access
/// counts (G1 hot keys).
pub(crate) struct KeyCell {
    pub(crate) sum: AtomicI64,
}

/// One holder of a key (24 bytes).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Holder {
    pub(crate) last_seen_ms: i64,
    pub(crate) cell: *const EntryCell,
    rep_tier: u32,
    pub(crate) tokens: i32,
}

impl Holder {
    #[inline]
    pub(crate) fn new(
        rep: u32,
        tier: u8,
        tokens: i32,
        last_seen_ms: i64,
        cell: *const EntryCell,
    ) -> Self {
        debug_assert!(rep <= REP_MASK);
        Self {
            last_seen_ms,
            cell,
            rep_tier: rep | ((tier as u32) << TIER_SHIFT),
            tokens,
        }
    }
    #[inline]
    pub(crate) fn rep(&self) -> u32 {
        self.rep_tier & REP_MASK
    }
    #[inline]
    pub(crate) fn tier(&self) -> u8 {
        (self.rep_tier >> TIER_SHIFT) as u8
    }
    #[inline]
    pub(crate) fn set_tier(&mut self, tier: u8) {
        self.rep_tier = self.rep() | ((tier as u32) << TIER_SHIFT);
    }
    /// The entry cell.
    #[inline]
    pub(crate) fn cell(&self) -> &EntryCell {
        // SAFETY: a holder is only reachable through a node that is reachable (or was reachable
        // while the current guard was pinned); the cell is freed through the epoch only after the
        // entry was removed from the current node, so it outlives every such reference.
        unsafe { &*self.cell }
    }
}

/// Key bytes: 8-byte keys inline, others boxed.
pub(crate) enum KeyBytes {
    Short([u8; 8]),
    Long(Box<[u8]>),
}

impl KeyBytes {
    pub(crate) fn from_bytes(b: &[u8]) -> Self {
        match <[u8; 8]>::try_from(b) {
            Ok(a) => KeyBytes::Short(a),
            Err(_) => KeyBytes::Long(b.into()),
        }
    }
    #[inline]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            KeyBytes::Short(a) => a,
            KeyBytes::Long(b) => b,
        }
    }
    #[inline]
    pub(crate) fn matches(&self, b: &[u8]) -> bool {
        match self {
            KeyBytes::Short(a) => b.len() == 8 && a[..] == b[..],
            KeyBytes::Long(k) => k[..] == b[..],
        }
    }
    fn heap_bytes(&self) -> usize {
        match self {
            KeyBytes::Short(_) => 0,
            KeyBytes::Long(b) => b.len() + ALLOC_OVERHEAD,
        }
    }
}

/// An immutable key node: the key and its holders sorted by scope-local replica index.
pub(crate) struct KeyNode {
    pub(crate) key: KeyBytes,
    pub(crate) kcell: *const KeyCell,
    pub(crate) holders: Box<[Holder]>,
}

// SAFETY: the raw pointers in a node point to cells that are only accessed through atomics and
// are freed through the epoch collector; a node is immutable once published.
unsafe impl Send for KeyNode {}
// SAFETY: see `Send`; shared access only reads immutable fields or atomics.
unsafe impl Sync for KeyNode {}

impl KeyNode {
    #[inline]
    pub(crate) fn holder(&self, rep: u32) -> Option<&Holder> {
        // Holders are few (usually ≤ 8); a linear scan beats a binary search there.
        if self.holders.len() <= 16 {
            self.holders.iter().find(|h| h.rep() == rep)
        } else {
            self.holders
                .binary_search_by_key(&rep, |h| h.rep())
                .ok()
                .map(|i| &self.holders[i])
        }
    }
    #[inline]
    pub(crate) fn kcell(&self) -> &KeyCell {
        // SAFETY: the key cell is freed through the epoch only after the key was unlinked from
        // the current table; a node reference implies a pinned guard from before that.
        unsafe { &*self.kcell }
    }
    pub(crate) fn bytes(&self) -> usize {
        std::mem::size_of::<KeyNode>()
            + self.holders.len() * std::mem::size_of::<Holder>()
            + 2 * ALLOC_OVERHEAD
            + self.key.heap_bytes()
    }
}

/// Bytes accounted per entry cell.
pub(crate) const ENTRY_CELL_BYTES: usize = std::mem::size_of::<EntryCell>() + ALLOC_OVERHEAD;
/// Bytes accounted per key cell.
pub(crate) const KEY_CELL_BYTES: usize = std::mem::size_of::<KeyCell>() + ALLOC_OVERHEAD;

/// The 64-bit digest of a key: an 8-byte key's big-endian value, else XXH3-64.
#[inline]
pub(crate) fn digest(b: &[u8]) -> u64 {
    match <[u8; 8]>::try_from(b) {
        Ok(a) => u64::from_be_bytes(a),
        Err(_) => xxhash_rust::xxh3::xxh3_64(b),
    }
}

#[inline]
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

#[inline]
fn tomb() -> *mut KeyNode {
    NonNull::<KeyNode>::dangling().as_ptr()
}

struct Slot {
    digest: AtomicU64,
    node: AtomicPtr<KeyNode>,
}

struct ShardTable {
    slots: Box<[Slot]>,
    mask: usize,
}

impl ShardTable {
    fn new(cap: usize) -> Self {
        debug_assert!(cap.is_power_of_two());
        let slots = (0..cap)
            .map(|_| Slot {
                digest: AtomicU64::new(0),
                node: AtomicPtr::new(std::ptr::null_mut()),
            })
            .collect::<Vec<_>>()
            .into_boxed_slice();
        Self {
            slots,
            mask: cap - 1,
        }
    }
    fn bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Slot>()
            + std::mem::size_of::<Self>()
            + 2 * ALLOC_OVERHEAD
    }
}

struct ShardState {
    live: usize,
    used: usize,
    rebuilds: u64,
}

struct Shard {
    table: Atomic<ShardTable>,
    w: Mutex<ShardState>,
}

/// A partition's key table.
pub(crate) struct KeyTable {
    shards: Box<[CachePadded<Shard>]>,
    /// Bytes held (nodes, cells, tables); Relaxed, exact once writes quiesce.
    bytes: AtomicI64,
}

impl KeyTable {
    pub(crate) fn new() -> Self {
        let shards: Box<[CachePadded<Shard>]> = (0..SHARDS)
            .map(|_| {
                CachePadded::new(Shard {
                    table: Atomic::new(ShardTable::new(MIN_CAP)),
                    w: Mutex::new(ShardState {
                        live: 0,
                        used: 0,
                        rebuilds: 0,
                    }),
                })
            })
            .collect();
        let t = Self {
            shards,
            bytes: AtomicI64::new(0),
        };
        let per = ShardTable::new(MIN_CAP).bytes() + std::mem::size_of::<CachePadded<Shard>>();
        t.add_bytes((per * SHARDS) as i64);
        t
    }

    #[inline]
    pub(crate) fn add_bytes(&self, b: i64) {
        self.bytes.fetch_add(b, Ordering::Relaxed);
    }

    pub(crate) fn bytes(&self) -> i64 {
        self.bytes.load(Ordering::Relaxed)
    }

    #[inline]
    fn shard_of(h: u64) -> usize {
        (h >> SHARD_SHIFT) as usize & (SHARDS - 1)
    }

    /// Reader lookup: wait-free (bounded probe, no locks, no retries).
    #[inline]
    pub(crate) fn find<'g>(&self, key: &[u8], guard: &'g Guard) -> Option<&'g KeyNode> {
        let d = digest(key);
        let h = mix(d);
        let shard = &self.shards[Self::shard_of(h)];
        let t = shard.table.load(Ordering::Acquire, guard);
        // SAFETY: shard tables are never null (created in `new`, replaced only by non-null
        // tables) and are retired through the epoch, so the table outlives `guard`.
        let t = unsafe { t.deref() };
        let mut i = h as usize & t.mask;
        loop {
            let s = &t.slots[i];
            let n = s.node.load(Ordering::Acquire);
            if n.is_null() {
                return None;
            }
            if n != tomb() && s.digest.load(Ordering::Relaxed) == d {
                // SAFETY: `n` is a live node published with Release (Acquire above); it is
                // retired through the epoch, so it stays valid while `guard` is pinned.
                let node = unsafe { &*n };
                if node.key.matches(key) {
                    return Some(node);
                }
            }
            i = (i + 1) & t.mask;
        }
    }

    /// Locks the shard that holds `key`.
    pub(crate) fn writer_for(&self, key: &[u8]) -> ShardWriter<'_> {
        let d = digest(key);
        let h = mix(d);
        self.writer(Self::shard_of(h))
    }

    /// Locks shard `i`.
    pub(crate) fn writer(&self, i: usize) -> ShardWriter<'_> {
        let shard = &self.shards[i];
        ShardWriter {
            shard,
            st: shard.w.lock(),
            table: self,
        }
    }

    /// Non-blocking walk over every live node (snapshot; may miss or repeat nodes moved by a
    /// concurrent rebuild; exact when writes quiesce).
    pub(crate) fn for_each_node<'g>(&self, guard: &'g Guard, mut f: impl FnMut(&'g KeyNode)) {
        for shard in self.shards.iter() {
            let t = shard.table.load(Ordering::Acquire, guard);
            // SAFETY: as in `find`.
            let t = unsafe { t.deref() };
            for s in t.slots.iter() {
                let n = s.node.load(Ordering::Acquire);
                if !n.is_null() && n != tomb() {
                    // SAFETY: as in `find`.
                    f(unsafe { &*n });
                }
            }
        }
    }
}

impl Drop for KeyTable {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no other thread can reach this table any more; nodes and cells
        // still linked from the current tables are owned by it. Retired (unlinked) objects are
        // owned by the epoch collector and are not touched here.
        unsafe {
            let guard = epoch::unprotected();
            for shard in self.shards.iter() {
                let t = shard.table.load(Ordering::Relaxed, guard);
                if t.is_null() {
                    continue;
                }
                let tab = t.into_owned();
                for s in tab.slots.iter() {
                    let n = s.node.load(Ordering::Relaxed);
                    if !n.is_null() && n != tomb() {
                        let node = Box::from_raw(n);
                        for h in node.holders.iter() {
                            drop(Box::from_raw(h.cell as *mut EntryCell));
                        }
                        drop(Box::from_raw(node.kcell as *mut KeyCell));
                    }
                }
            }
        }
    }
}

/// Exclusive writer access to one shard.
pub(crate) struct ShardWriter<'a> {
    shard: &'a Shard,
    st: MutexGuard<'a, ShardState>,
    table: &'a KeyTable,
}

impl ShardWriter<'_> {
    fn current<'g>(&self, guard: &'g Guard) -> &'g ShardTable {
        // SAFETY: non-null (see `KeyTable::find`); only we (mutex holder) replace it, and the
        // old one is retired through the epoch.
        unsafe { self.shard.table.load(Ordering::Acquire, guard).deref() }
    }

    /// Finds `key`: its slot index and node.
    pub(crate) fn find<'g>(&self, key: &[u8], guard: &'g Guard) -> Option<(usize, &'g KeyNode)> {
        let d = digest(key);
        let h = mix(d);
        let t = self.current(guard);
        let mut i = h as usize & t.mask;
        loop {
            let s = &t.slots[i];
            let n = s.node.load(Ordering::Acquire);
            if n.is_null() {
                return None;
            }
            if n != tomb() && s.digest.load(Ordering::Relaxed) == d {
                // SAFETY: live node, see `KeyTable::find`.
                let node = unsafe { &*n };
                if node.key.matches(key) {
                    return Some((i, node));
                }
            }
            i = (i + 1) & t.mask;
        }
    }

    /// Number of slots of the current table (for sliced walks).
    pub(crate) fn capacity(&self, guard: &Guard) -> usize {
        self.current(guard).slots.len()
    }

    /// Counter bumped by every rebuild (a sliced walk restarts when it changes).
    pub(crate) fn rebuilds(&self) -> u64 {
        self.st.rebuilds
    }

    /// The live node at slot `i`, if any.
    pub(crate) fn node_at<'g>(&self, i: usize, guard: &'g Guard) -> Option<&'g KeyNode> {
        let t = self.current(guard);
        let n = t.slots.get(i)?.node.load(Ordering::Acquire);
        if n.is_null() || n == tomb() {
            None
        } else {
            // SAFETY: live node, see `KeyTable::find`.
            Some(unsafe { &*n })
        }
    }

    /// Replaces the node at slot `i` (same key) and retires the old node (not its cells).
    pub(crate) fn replace(&mut self, i: usize, node: KeyNode, guard: &Guard) {
        let t = self.current(guard);
        self.table.add_bytes(node.bytes() as i64);
        let new = Box::into_raw(Box::new(node));
        let old = t.slots[i].node.swap(new, Ordering::AcqRel);
        debug_assert!(!old.is_null() && old != tomb());
        self.retire_node(old, guard);
    }

    fn retire_node(&self, old: *mut KeyNode, guard: &Guard) {
        // SAFETY: `old` was a live node that is now unlinked from the current table; readers
        // pinned before the unlink may still read it, so it is destroyed through the epoch.
        unsafe {
            self.table.add_bytes(-((*old).bytes() as i64));
            guard.defer_destroy(Shared::from(old as *const KeyNode));
        }
    }

    /// Deletes the key at slot `i` (tombstone) and retires its node (not its cells).
    pub(crate) fn remove(&mut self, i: usize, guard: &Guard) {
        let t = self.current(guard);
        let old = t.slots[i].node.swap(tomb(), Ordering::AcqRel);
        debug_assert!(!old.is_null() && old != tomb());
        self.retire_node(old, guard);
        self.st.live -= 1;
    }

    /// Shrinks the table when it is mostly empty (call outside sliced walks).
    pub(crate) fn maybe_shrink(&mut self, guard: &Guard) {
        let cap = self.capacity(guard);
        if cap > MIN_CAP && self.st.live * 8 < cap {
            self.rebuild(guard);
        }
    }

    /// Inserts a new key (the caller checked it is absent).
    pub(crate) fn insert(&mut self, node: KeyNode, guard: &Guard) {
        let cap = self.capacity(guard);
        if (self.st.used + 1) * 4 > cap * 3 {
            self.rebuild(guard);
        }
        let d = digest(node.key.as_bytes());
        let h = mix(d);
        let t = self.current(guard);
        let mut i = h as usize & t.mask;
        while !t.slots[i].node.load(Ordering::Relaxed).is_null() {
            i = (i + 1) & t.mask;
        }
        self.table.add_bytes(node.bytes() as i64);
        let new = Box::into_raw(Box::new(node));
        t.slots[i].digest.store(d, Ordering::Relaxed);
        t.slots[i].node.store(new, Ordering::Release);
        self.st.live += 1;
        self.st.used += 1;
    }

    /// Rebuilds the table sized for the live keys (drops tombstones, grows or shrinks).
    fn rebuild(&mut self, guard: &Guard) {
        let old_shared = self.shard.table.load(Ordering::Acquire, guard);
        // SAFETY: non-null, see `current`.
        let old = unsafe { old_shared.deref() };
        let cap = ((self.st.live + 1) * 2).next_power_of_two().max(MIN_CAP);
        let new = ShardTable::new(cap);
        for s in old.slots.iter() {
            let n = s.node.load(Ordering::Relaxed);
            if n.is_null() || n == tomb() {
                continue;
            }
            let d = s.digest.load(Ordering::Relaxed);
            let mut i = mix(d) as usize & new.mask;
            while !new.slots[i].node.load(Ordering::Relaxed).is_null() {
                i = (i + 1) & new.mask;
            }
            new.slots[i].digest.store(d, Ordering::Relaxed);
            new.slots[i].node.store(n, Ordering::Relaxed);
        }
        let delta = new.bytes() as i64 - old.bytes() as i64;
        self.table.add_bytes(delta);
        // Release: publishes the fully built table.
        self.shard.table.store(Owned::new(new), Ordering::Release);
        // SAFETY: the old table is unlinked; pinned readers may still probe it. Dropping a
        // `ShardTable` frees only its slot array, never the nodes (which moved to the new table).
        unsafe { guard.defer_destroy(old_shared) };
        self.st.used = self.st.live;
        self.st.rebuilds += 1;
    }
}
