//! Per-shard node arena: where a key table's [`KeyNode`](crate::raw::node::KeyNode)s live.
//!
//! # Why
//!
//! With one `malloc` per node, every node pays the allocator's header and 16-byte rounding (a
//! 24-byte single-holder node took a 32-byte chunk, a 40-byte one 48), and every table lane held
//! an 8-byte pointer. The arena hands out nodes at their exact size in 8-byte units and names them
//! by a 32-bit index, which halves the lanes (see `table.rs`): on W1M that is ~9 bytes less per
//! storage entry, and a chain's new nodes are carved one after the other from the same chunk.
//!
//! # Layout
//!
//! Memory comes in chunks: the first is 128 bytes and each new one doubles, up to 256 KiB (so
//! a partition with a handful of keys stays small: a new tenant's first entry used to take a
//! 4 KiB first chunk, half of what that tenant cost, then 256 bytes). A node index is `chunk << 15 | offset`, the
//! offset in 8-byte units (2^15 units = 256 KiB), the chunk id up to 2^17. Chunk id 0 is never
//! used, so index 0 means "no node". While the chunk ids stay below 2^9 (~128 MiB of nodes)
//! every index fits in 24 bits, which is what lets a table pack a lane's tag and index into 4
//! bytes (narrow tables, `table.rs`); [`ArenaState::index_bound`] tells the table when not.
//! Nodes of up to [`MAX_CLASS_UNITS`] units are carved from the current chunk or reused from a
//! free list of exactly their size; a larger node (more than ~60 holders) gets a chunk of its
//! own, released with it.
//!
//! # Concurrency
//!
//! - **Allocation** happens only under the shard's writer mutex ([`ArenaState`] lives in the
//!   mutex-protected shard state), so bump pointers and free lists need no atomics.
//! - **Readers** translate an index through the directory of chunk base pointers
//!   ([`Arena::node`]). A reader only ever holds an index it loaded (Acquire) from a table lane;
//!   the writer stored the chunk's directory entry (and, on growth, published the new directory,
//!   Release) before the lane's Release store, so the reader sees both. A directory that grows
//!   is copied and republished; the old one is retired through the epoch, like a table.
//! - **Freeing**: the shard's writers collect unlinked nodes in a [`Batch`] (64 nodes; kept in
//!   the shard state across writer sessions, flushed when full and before a compaction). A full
//!   batch goes to the epoch as one deferred function; once every reader pinned before it has
//!   unpinned, the function puts the batch on the [`Owner`]'s `freed` list (a mutex: batches
//!   arrive from whichever thread collects garbage, often a reader inside a lookup, so the list
//!   is linked through the batches and the function allocates nothing). The writer drains that
//!   list into its free lists when a size class runs dry (after one unlocked load of a flag
//!   kept with the list, so a growing shard does not lock per node), and recycles the empty
//!   batch. Nothing
//!   is reused before its epoch has passed, so a pinned reader never sees a node change under it
//!   (the same argument as for freeing, `table.rs` invariant 4); handing a node to the epoch
//!   later than its unlink only delays its reuse.
//! - **Lifetime**: the chunks belong to the [`Owner`], shared (`Arc`) by the table(s) using the
//!   arena and by every batch waiting for its epoch, so a batch released after the table is
//!   dropped still has somewhere to go; the last reference frees the chunks.
//!
//! The directory uses `std` atomics even in loom builds: a directory entry is written once
//! before any index into its chunk is published, so the lane's (loom-checked) Release/Acquire
//! pair already orders it, and modelling it would only multiply loom's interleavings.

use crate::raw::pages;
use crate::sync::{AtomicBool, Mutex, Ordering};
use crossbeam_epoch::Guard;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::AtomicPtr as StdAtomicPtr;

/// Bytes per allocation unit.
pub(crate) const UNIT: usize = 8;
/// Offset bits of a node index (2^15 units of 8 bytes = 256 KiB per chunk).
const OFF_BITS: u32 = 15;
const OFF_MASK: u32 = (1 << OFF_BITS) - 1;
/// Largest chunk carved into nodes, in units.
const MAX_CHUNK_UNITS: u32 = 1 << OFF_BITS;
/// First chunk, in units (128 bytes: room for a few entries; a partition's first entry is
/// part of what a new identity costs, issue 28's 1 KiB per record).
const FIRST_CHUNK_UNITS: u32 = 16;
/// Chunk ids are the upper 17 bits of an index.
const MAX_CHUNKS: usize = 1 << (32 - OFF_BITS);
/// Largest node carved from shared chunks (1 KiB: up to 63 holders with an 8-byte key); bigger
/// nodes get a chunk of their own.
pub(crate) const MAX_CLASS_UNITS: u32 = 128;
/// Nodes per retirement batch (the writer flushes a full batch; see `hooks::BATCH_CAPACITY`).
pub(crate) const BATCH_CAPACITY: usize = crate::raw::hooks::BATCH_CAPACITY;
/// Units of a member node (`table::KeyNode`), the smallest node.
const MEMBER_UNITS: u32 = 2;
/// The even sizes in a word of `ArenaState::avail`.
const EVEN: u64 = 0x5555_5555_5555_5555;
/// Empty batches an arena's writer keeps for reuse.
const SPARE_BATCHES: usize = 16;

/// Units needed for `bytes`.
#[inline]
pub(crate) fn units_for(bytes: usize) -> u32 {
    bytes.div_ceil(UNIT) as u32
}

/// The readers' view: chunk base pointers by chunk id.
struct ChunkDirectory {
    chunks: Box<[StdAtomicPtr<u8>]>,
}

impl ChunkDirectory {
    fn with_capacity(n: usize) -> Box<Self> {
        Box::new(ChunkDirectory {
            chunks: (0..n)
                .map(|_| StdAtomicPtr::new(std::ptr::null_mut()))
                .collect(),
        })
    }
}

/// A node waiting for its epoch.
struct Retired {
    idx: u32,
    units: u32,
    /// The node's address, for the loom ledger.
    #[cfg(loom)]
    addr: usize,
}

/// Nodes unlinked by one writer, handed to the epoch together (one deferred function per
/// batch). Batches are recycled: the writer takes them back with the nodes they carry, so a
/// steady stream of removals allocates nothing.
pub(crate) struct Batch {
    items: Vec<Retired>,
    /// Keeps the arena's memory alive while the batch waits for its epoch (None once handed
    /// back, so the owner's list of returned batches holds no reference to the owner itself).
    owner: Option<Arc<Owner>>,
    /// The next batch on the owner's `freed` list.
    next: Option<Box<Batch>>,
}

impl Batch {
    /// Nodes in the batch.
    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }
}

/// What the arena owns: its chunks, and the frees not yet taken back by the writer.
pub(crate) struct Owner {
    /// `(base, bytes)` by chunk id; `(null, 0)` for a released single-node chunk.
    chunks: Mutex<Vec<(usize, usize)>>,
    /// Batches whose epoch has passed, waiting for the writer: a list linked through the
    /// batches themselves, so the deferred function that returns a batch never allocates.
    /// (It runs on whichever thread collects garbage, often a reader inside a lookup, which
    /// must stay allocation-free: T93.)
    freed: Mutex<Freed>,
    /// Whether `freed` may hold a batch: set with each push and cleared with each take, both
    /// under its mutex. The writer reads it without the lock on every free-list miss (every
    /// node a growing shard carves fresh), so that the common "nothing came back" costs one
    /// load instead of a lock and unlock (~10% of an insert of fresh chains). A stale `false`
    /// only leaves a returned batch for the next miss.
    has_freed: AtomicBool,
}

impl Owner {
    /// Puts a batch whose epoch has passed on the `freed` list.
    fn give(&self, b: Box<Batch>) {
        let mut f = self.freed.lock();
        f.push(b);
        self.has_freed.store(true, Ordering::Relaxed);
    }

    /// Takes the whole `freed` list (follow `next`), if anything may be on it.
    fn take_freed(&self) -> Option<Box<Batch>> {
        if !self.has_freed.load(Ordering::Relaxed) {
            return None;
        }
        let mut f = self.freed.lock();
        self.has_freed.store(false, Ordering::Relaxed);
        f.take()
    }
}

/// The owner's list of returned batches (see [`Owner`]).
#[derive(Default)]
struct Freed {
    head: Option<Box<Batch>>,
}

impl Freed {
    fn push(&mut self, mut b: Box<Batch>) {
        b.next = self.head.take();
        self.head = Some(b);
    }

    /// The whole list (follow `next`).
    fn take(&mut self) -> Option<Box<Batch>> {
        self.head.take()
    }

    #[cfg(all(test, not(loom)))]
    fn is_empty(&self) -> bool {
        self.head.is_none()
    }
}

impl Drop for Freed {
    fn drop(&mut self) {
        // Iteratively: a burst of removals can leave thousands of batches on the list.
        let mut next = self.head.take();
        while let Some(mut b) = next {
            next = b.next.take();
        }
    }
}

#[cfg(all(test, not(loom)))]
impl Owner {
    /// Takes back a node as if its epoch had passed (a one-node batch on the `freed` list).
    fn release(&self, idx: u32, units: u32) {
        self.give(Box::new(Batch {
            items: vec![Retired { idx, units }],
            owner: None,
            next: None,
        }));
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        for &(base, bytes) in self.chunks.lock().iter() {
            if base != 0 {
                // SAFETY: allocated by `pages::alloc(bytes)` in `ArenaState::new_chunk`; the
                // last reference to the owner is going away, so no node in it is reachable.
                unsafe { pages::free(NonNull::new_unchecked(base as *mut u8), bytes) }
            }
        }
    }
}

/// The shared half of a shard's arena (lives in the shard, next to its table pointer).
pub(crate) struct Arena {
    dir: StdAtomicPtr<ChunkDirectory>,
    owner: Arc<Owner>,
}

impl Arena {
    pub(crate) fn new() -> Self {
        Self {
            dir: StdAtomicPtr::new(Box::into_raw(ChunkDirectory::with_capacity(4))),
            owner: Arc::new(Owner {
                // Chunk id 0 stays unused: index 0 is "no node".
                // Room for the first chunk too, so a one-chunk arena does not regrow it.
                chunks: Mutex::new({
                    let mut v = Vec::with_capacity(2);
                    v.push((0, 0));
                    v
                }),
                freed: Mutex::new(Freed::default()),
                has_freed: AtomicBool::new(false),
            }),
        }
    }

    /// The node at `idx` (non-zero, loaded with Acquire from a lane of this shard's table or
    /// handed out by [`ArenaState::alloc`]).
    #[inline]
    pub(crate) fn node(&self, idx: u32) -> *mut u8 {
        // SAFETY: the directory is never null and is retired through the epoch when replaced;
        // callers are pinned (they hold an index read from a lane under a guard, or are the
        // writer).
        let dir = unsafe { &*self.dir.load(Ordering::Acquire) };
        let base = dir.chunks[(idx >> OFF_BITS) as usize].load(Ordering::Acquire);
        base.wrapping_add((idx & OFF_MASK) as usize * UNIT)
    }

    /// Adds node `idx` of `units` units, just unlinked, to `batch`.
    #[inline]
    pub(crate) fn add_retired(&self, batch: &mut Batch, idx: u32, units: u32) {
        batch.items.push(Retired {
            idx,
            units,
            #[cfg(loom)]
            addr: self.node(idx) as usize,
        });
    }

    /// Retires a batch of nodes of this arena: they are handed back to the writer once every
    /// reader pinned now has unpinned. (One deferred function per batch instead of one per
    /// node: the writer collects a session's retirements, see `table::ShardWriter`.)
    ///
    /// # Safety
    /// Every node of `batch` is unreachable for readers that pin after this call, and is
    /// retired once.
    pub(crate) unsafe fn retire_batch(&self, mut batch: Box<Batch>, guard: &Guard) {
        batch.owner = Some(self.owner.clone());
        // One word, so crossbeam stores the deferred function inline (no allocation).
        let raw = Box::into_raw(batch) as usize;
        // SAFETY: per the contract. `raw` is a leaked box, reclaimed exactly once by the
        // closure; the batch's `owner` keeps the arena's memory alive until then.
        unsafe {
            guard.defer_unchecked(move || {
                let mut b = Box::from_raw(raw as *mut Batch);
                #[cfg(loom)]
                for r in &b.items {
                    crate::raw::hooks::destroyed(crate::raw::hooks::Kind::Node, r.addr);
                }
                if let Some(owner) = b.owner.take() {
                    owner.give(b);
                }
            })
        };
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no reader can reach this arena's directory any more (the table
        // that indexes it is being dropped); older directories were retired separately.
        unsafe { drop(Box::from_raw(self.dir.load(Ordering::Relaxed))) };
    }
}

/// The writer half (inside the shard's mutex-protected state).
pub(crate) struct ArenaState {
    /// Free-list heads by size in units (intrusive: the next index is in a free node's first
    /// word; 0 ends a list).
    /// Allocated by the first node given back (a partition that never loses a node, like a
    /// new tenant's first entry, does without its 516 bytes).
    heads: Option<Box<[u32; MAX_CLASS_UNITS as usize + 1]>>,
    /// Bit `u` set: the free list of size `u` is not empty.
    avail: [u64; 3],
    /// Current chunk id, its next free unit and its size in units.
    cur: u32,
    used: u32,
    cap: u32,
    /// Chunk ids in use (including released single-node chunks awaiting reuse).
    nchunks: u32,
    /// Released single-node chunk ids.
    spare_ids: Vec<u32>,
    /// Empty batches to reuse (boxed, as they travel).
    #[allow(clippy::vec_box)]
    spare_batches: Vec<Box<Batch>>,
    /// Bytes obtained from the system allocator (chunks + directories).
    bytes: i64,
    /// See [`ArenaState::carved`].
    carved: i64,
}

impl ArenaState {
    pub(crate) fn new() -> Self {
        Self {
            heads: None,
            avail: [0; 3],
            cur: 0,
            used: 0,
            cap: 0,
            nchunks: 1,
            spare_ids: Vec::new(),
            spare_batches: Vec::new(),
            bytes: 0,
            carved: 0,
        }
    }

    /// Bytes ever handed out as nodes and still owned (carved from chunks, free-listed or live,
    /// plus single-node chunks): what the arena holds, without the unused tail of its current
    /// chunk, which a fresh arena's doubling chunks would have too.
    pub(crate) fn carved(&self) -> i64 {
        self.carved
    }

    /// Bytes obtained from the system allocator so far (chunks, directories).
    pub(crate) fn bytes(&self) -> i64 {
        self.bytes
    }

    /// An upper bound (exclusive) on every index handed out so far: the chunk ids in use.
    /// Until a new chunk id is taken, every node of this arena has an index below it.
    pub(crate) fn index_bound(&self) -> u64 {
        (self.nchunks as u64) << OFF_BITS
    }

    /// A node of `units` units: its index and address. Mutex holder only.
    pub(crate) fn alloc(&mut self, a: &Arena, units: u32, guard: &Guard) -> (u32, *mut u8) {
        debug_assert!(units >= 1);
        if units > MAX_CLASS_UNITS {
            let id = self.new_chunk(a, units, guard);
            self.carved += units as i64 * UNIT as i64;
            let idx = id << OFF_BITS;
            return (idx, a.node(idx));
        }
        if self.head(units) == 0 {
            self.take_back(a);
        }
        if let Some(idx) = self.pop(a, units) {
            return (idx, a.node(idx));
        }
        // Split a larger free node (see `split_source`): sizes nobody asks for any more (a
        // key's intermediate holder counts while it grew) are recycled instead of stranded.
        if let Some(v) = self.split_source(units)
            && let Some(idx) = self.pop(a, v)
        {
            self.push(a, idx + units, v - units);
            return (idx, a.node(idx));
        }
        if self.cap == 0 || self.used + units > self.cap {
            let mut next = if self.cap == 0 {
                FIRST_CHUNK_UNITS
            } else {
                (self.cap * 2).min(MAX_CHUNK_UNITS)
            };
            // The first chunks are smaller than the largest carved node: double until it fits
            // (carved nodes are at most `MAX_CLASS_UNITS` ≤ `MAX_CHUNK_UNITS`).
            while next < units {
                next = (next * 2).min(MAX_CHUNK_UNITS);
            }
            self.cur = self.new_chunk(a, next, guard);
            self.cap = next;
            self.used = 0;
        }
        let idx = self.cur << OFF_BITS | self.used;
        self.used += units;
        self.carved += units as i64 * UNIT as i64;
        (idx, a.node(idx))
    }

    /// An empty batch: a recycled one, taking back the batches whose epoch has passed first
    /// when no spare is left. (Otherwise those would wait for the next free-list miss while
    /// every retirement allocated a new batch: a burst of removals, such as an ALL_CLEARED
    /// cleanup, then left thousands of dead batches behind in the heap, ~2 MiB at a 1 M cap.)
    pub(crate) fn new_batch(&mut self, a: &Arena) -> Box<Batch> {
        if self.spare_batches.is_empty() {
            self.take_back(a);
        }
        self.spare_batches.pop().unwrap_or_else(|| {
            Box::new(Batch {
                items: Vec::with_capacity(BATCH_CAPACITY),
                owner: None,
                next: None,
            })
        })
    }

    /// Moves the frees whose epoch has passed into the free lists (single-node chunks go back
    /// to the system allocator).
    fn take_back(&mut self, a: &Arena) {
        let mut next = a.owner.take_freed();
        while let Some(mut b) = next {
            next = b.next.take();
            for r in b.items.drain(..) {
                self.give_back(a, r.idx, r.units);
            }
            if self.spare_batches.len() < SPARE_BATCHES {
                self.spare_batches.push(b);
            }
        }
    }

    /// One node whose epoch has passed back into the free lists.
    fn give_back(&mut self, a: &Arena, idx: u32, units: u32) {
        if units <= MAX_CLASS_UNITS {
            self.push(a, idx, units);
            return;
        }
        // A node with a chunk of its own: the chunk goes back to the system allocator and its
        // id is kept for reuse.
        let id = idx >> OFF_BITS;
        let (base, bytes) = std::mem::take(&mut a.owner.chunks.lock()[id as usize]);
        // SAFETY: the directory is never null (see `Arena::node`).
        let dir = unsafe { &*a.dir.load(Ordering::Acquire) };
        dir.chunks[id as usize].store(std::ptr::null_mut(), Ordering::Relaxed);
        // SAFETY: allocated by `pages::alloc(bytes)` in `new_chunk` (non-null: a registered
        // chunk); its only node's epoch has passed, so nothing can reach it.
        unsafe { pages::free(NonNull::new_unchecked(base as *mut u8), bytes) };
        self.bytes -= pages::footprint(bytes) as i64;
        self.carved -= bytes as i64;
        self.spare_ids.push(id);
    }

    /// Pushes free node `idx` of `units` units (its epoch has passed) onto its list.
    fn push(&mut self, a: &Arena, idx: u32, units: u32) {
        let p = a.node(idx);
        let heads = self
            .heads
            .get_or_insert_with(|| Box::new([0; MAX_CLASS_UNITS as usize + 1]));
        // SAFETY: a node of this arena that no reader can reach (its epoch has passed, or it is
        // the unused remainder of a split one): only the writer (us) touches it; its first word
        // becomes the free-list link.
        unsafe { (p as *mut u32).write(heads[units as usize]) };
        heads[units as usize] = idx;
        self.avail[units as usize / 64] |= 1 << (units % 64);
    }

    /// The first free node of `units` units (0: none).
    #[inline]
    fn head(&self, units: u32) -> u32 {
        self.heads.as_ref().map_or(0, |h| h[units as usize])
    }

    /// Pops a free node of exactly `units` units.
    fn pop(&mut self, a: &Arena, units: u32) -> Option<u32> {
        let head = self.head(units);
        if head == 0 {
            return None;
        }
        crate::raw::hooks::reused();
        // SAFETY: a free node of this class: its first word holds the next free index (written
        // by `push`); no reader can reach it.
        let next = unsafe { (a.node(head) as *const u32).read() };
        if let Some(heads) = self.heads.as_mut() {
            heads[units as usize] = next;
        }
        if next == 0 {
            self.avail[units as usize / 64] &= !(1 << (units % 64));
        }
        Some(head)
    }

    /// The free size to split for a request of `units`, so that no remainder is stranded.
    /// Nodes with 8-byte keys have 2 units (member nodes, most of them) or an odd number (1 + 2
    /// per holder). A member node takes from the smallest even size (the remainder is even, so
    /// member nodes can use all of it); any other request from the smallest size that leaves
    /// at least 2 units (an even remainder goes to member nodes, an odd one to odd requests).
    /// Members splitting odd sizes left 3- and 6-unit remainders nobody asked for: ~1.3 bytes
    /// per entry of W1M.
    fn split_source(&self, units: u32) -> Option<u32> {
        if units == MEMBER_UNITS {
            return self.larger_than_masked(units + 1, EVEN);
        }
        self.larger_than_masked(units + 1, !0)
    }

    /// The smallest size above `units` with a free node, among the sizes `mask` selects (bit
    /// `u % 64` for size `u`).
    fn larger_than_masked(&self, units: u32, mask: u64) -> Option<u32> {
        let from = units as usize + 1;
        if from > MAX_CLASS_UNITS as usize {
            return None;
        }
        let (mut w, b) = (from / 64, from % 64);
        let mut bits = self.avail[w] & mask & (!0u64 << b);
        loop {
            if bits != 0 {
                return Some((w * 64) as u32 + bits.trailing_zeros());
            }
            w += 1;
            if w >= self.avail.len() {
                return None;
            }
            bits = self.avail[w] & mask;
        }
    }

    /// Allocates a chunk of `units` units, registers it and returns its id.
    fn new_chunk(&mut self, a: &Arena, units: u32, guard: &Guard) -> u32 {
        let bytes = units as usize * UNIT;
        let base = pages::alloc(bytes).as_ptr();
        let mut chunks = a.owner.chunks.lock();
        let id = match self.spare_ids.pop() {
            Some(id) => {
                chunks[id as usize] = (base as usize, bytes);
                id
            }
            None => {
                let id = self.nchunks;
                assert!(
                    (id as usize) < MAX_CHUNKS,
                    "node arena exhausted (32 GiB per shard)"
                );
                self.nchunks += 1;
                chunks.push((base as usize, bytes));
                id
            }
        };
        drop(chunks);
        self.bytes += pages::footprint(bytes) as i64;
        // SAFETY: never null; only the writer (us) replaces it.
        let dir = unsafe { &*a.dir.load(Ordering::Acquire) };
        if (id as usize) < dir.chunks.len() {
            dir.chunks[id as usize].store(base, Ordering::Release);
        } else {
            let grown = ChunkDirectory::with_capacity((dir.chunks.len() * 2).max(id as usize + 1));
            for (i, c) in dir.chunks.iter().enumerate() {
                grown.chunks[i].store(c.load(Ordering::Relaxed), Ordering::Relaxed);
            }
            grown.chunks[id as usize].store(base, Ordering::Relaxed);
            self.bytes += (grown.chunks.len() * 8) as i64;
            let old = a.dir.swap(Box::into_raw(grown), Ordering::AcqRel);
            self.bytes -= (dir.chunks.len() * 8) as i64;
            let old = old as usize;
            // SAFETY: the old directory is unlinked; readers pinned before the swap may still
            // read it, so it is freed through the epoch.
            unsafe {
                guard.defer_unchecked(move || drop(Box::from_raw(old as *mut ChunkDirectory)))
            };
        }
        id
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crossbeam_epoch as epoch;

    #[test]
    fn nodes_are_exact_sized_and_reused_only_after_release() {
        let a = Arena::new();
        let mut st = ArenaState::new();
        let guard = epoch::pin();
        let (i1, p1) = st.alloc(&a, 3, &guard);
        let (i2, p2) = st.alloc(&a, 3, &guard);
        assert_ne!(i1, 0, "index 0 is never handed out");
        assert_eq!(p2 as usize - p1 as usize, 3 * UNIT, "carved back to back");
        assert_eq!(i2, i1 + 3);
        assert_eq!(
            st.bytes(),
            pages::footprint(FIRST_CHUNK_UNITS as usize * UNIT) as i64
        );
        a.owner.release(i1, 3);
        let (i3, p3) = st.alloc(&a, 3, &guard);
        assert_eq!(
            (i3, p3),
            (i1, p1),
            "a released node of the same size is reused"
        );
        let (i4, _) = st.alloc(&a, 5, &guard);
        assert_eq!(i4, i2 + 3, "other sizes keep carving");
    }

    /// The writer looks at the freed list only when its flag says something came back: a
    /// batch returned after a take-back (which cleared the flag) is still found, and the flag
    /// follows the list.
    #[test]
    fn batches_returned_after_a_take_back_are_still_found() {
        let a = Arena::new();
        let mut st = ArenaState::new();
        let guard = epoch::pin();
        let (i1, _) = st.alloc(&a, 3, &guard);
        let (i2, _) = st.alloc(&a, 3, &guard);
        assert!(
            !a.owner.has_freed.load(Ordering::Relaxed),
            "nothing returned yet"
        );
        a.owner.release(i1, 3);
        assert!(a.owner.has_freed.load(Ordering::Relaxed));
        assert_eq!(st.alloc(&a, 3, &guard).0, i1, "taken back and reused");
        assert!(
            !a.owner.has_freed.load(Ordering::Relaxed),
            "the take-back cleared it"
        );
        assert!(a.owner.freed.lock().is_empty());
        a.owner.release(i2, 3);
        assert_eq!(st.alloc(&a, 3, &guard).0, i2, "a later return is found too");
        let (i3, _) = st.alloc(&a, 3, &guard);
        assert!(i3 != i1 && i3 != i2, "nothing else came back: carved fresh");
    }

    #[test]
    fn larger_free_nodes_are_split_with_a_usable_remainder() {
        let a = Arena::new();
        let mut st = ArenaState::new();
        let guard = epoch::pin();
        let (big, _) = st.alloc(&a, 15, &guard);
        let (_, _) = st.alloc(&a, 3, &guard);
        a.owner.release(big, 15);
        // 15 = 3 + 12: the 3-unit request takes the front, the 12 units stay free.
        let (x, _) = st.alloc(&a, 3, &guard);
        assert_eq!(x, big);
        let (y, _) = st.alloc(&a, 12, &guard);
        assert_eq!(y, big + 3, "the remainder serves its own size");
        // 4 = 3 + 1 would strand a unit: a 4-unit free node is not split for 3.
        let (four, _) = st.alloc(&a, 4, &guard);
        a.owner.release(four, 4);
        st.take_back(&a);
        let (z, _) = st.alloc(&a, 3, &guard);
        assert_ne!(z, four);
        let (w, _) = st.alloc(&a, 4, &guard);
        assert_eq!(w, four);
    }

    /// Member nodes (2 units) split only even free sizes, so what they leave is even again;
    /// odd requests leave at least 2 units, which member nodes then take.
    #[test]
    fn member_nodes_split_even_sizes_and_take_odd_requests_remainders() {
        let a = Arena::new();
        let mut st = ArenaState::new();
        let guard = epoch::pin();
        let (five, _) = st.alloc(&a, 5, &guard);
        let (six, _) = st.alloc(&a, 6, &guard);
        let (_, _) = st.alloc(&a, 3, &guard);
        a.owner.release(five, 5);
        a.owner.release(six, 6);
        st.take_back(&a);
        let members: Vec<u32> = (0..3).map(|_| st.alloc(&a, 2, &guard).0).collect();
        assert_eq!(
            members,
            [six, six + 2, six + 4],
            "6 = 2 + 4, then 4 = 2 + 2, then the last 2; the odd 5 is left alone"
        );
        let (x, _) = st.alloc(&a, 3, &guard);
        assert_eq!(x, five, "5 = 3 + 2");
        let (m, _) = st.alloc(&a, 2, &guard);
        assert_eq!(
            m,
            five + 3,
            "the odd request's remainder serves a member node"
        );
    }

    #[test]
    fn a_writer_reuses_returned_batches_before_allocating_new_ones() {
        let a = Arena::new();
        let mut st = ArenaState::new();
        let guard = epoch::pin();
        // A burst of retirements: 8 full batches through the epoch to the `freed` list, as
        // their deferred functions would leave them.
        let mut addrs = std::collections::HashSet::new();
        let mut in_flight = Vec::new();
        for _ in 0..8 {
            let mut b = st.new_batch(&a);
            assert!(addrs.insert(&*b as *const Batch as usize), "a new batch");
            for _ in 0..BATCH_CAPACITY {
                let (i, _) = st.alloc(&a, 3, &guard);
                a.add_retired(&mut b, i, 3);
            }
            in_flight.push(b);
        }
        for b in in_flight {
            a.owner.give(b);
        }
        // With no spare left, the next batches are the returned ones, and their nodes are
        // back in the free lists (no free-list miss needed to take them back).
        for _ in 0..8 {
            let b = st.new_batch(&a);
            assert!(
                addrs.contains(&(&*b as *const Batch as usize)),
                "a returned batch"
            );
            assert!(b.items.is_empty());
            st.spare_batches.push(b);
        }
        assert!(a.owner.freed.lock().is_empty());
        let carved = st.carved();
        for _ in 0..8 * BATCH_CAPACITY {
            st.alloc(&a, 3, &guard);
        }
        assert_eq!(
            st.carved(),
            carved,
            "the burst's nodes were reused, none carved"
        );
    }

    #[test]
    fn chunks_double_and_the_directory_grows() {
        let a = Arena::new();
        let mut st = ArenaState::new();
        let guard = epoch::pin();
        let mut seen = std::collections::HashSet::new();
        // 2 MiB of 1 KiB nodes: chunks of 4, 8, ..., 256 KiB, then more of 256 KiB.
        for _ in 0..2048 {
            let (i, p) = st.alloc(&a, MAX_CLASS_UNITS, &guard);
            assert!(seen.insert(i));
            assert_eq!(a.node(i), p);
            // SAFETY: a fresh node of 1 KiB.
            unsafe { std::ptr::write_bytes(p, 0xab, MAX_CLASS_UNITS as usize * UNIT) };
        }
        assert!(st.nchunks > 4);
        let chunk_bytes: usize = a.owner.chunks.lock().iter().map(|c| c.1).sum();
        assert!(chunk_bytes >= 2 << 20);
    }

    #[test]
    fn big_nodes_get_their_own_chunk_and_give_it_back() {
        let a = Arena::new();
        let mut st = ArenaState::new();
        let guard = epoch::pin();
        let (_, _) = st.alloc(&a, 3, &guard);
        let before = st.bytes();
        let (big, p) = st.alloc(&a, MAX_CLASS_UNITS + 1, &guard);
        // SAFETY: a fresh node of that size.
        unsafe { std::ptr::write_bytes(p, 1, (MAX_CLASS_UNITS as usize + 1) * UNIT) };
        assert_eq!(big & OFF_MASK, 0);
        assert_eq!(
            st.bytes() - before,
            pages::footprint((MAX_CLASS_UNITS + 1) as usize * UNIT) as i64
        );
        a.owner.release(big, MAX_CLASS_UNITS + 1);
        st.take_back(&a);
        assert_eq!(
            st.bytes(),
            before,
            "the chunk went back to the system allocator"
        );
        let (again, _) = st.alloc(&a, MAX_CLASS_UNITS + 2, &guard);
        assert_eq!(again, big, "its chunk id is reused");
    }
}
