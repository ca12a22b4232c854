//! Wait-free directories and read-copy-update cells, the containers of the index's interned
//! records (`index/records.rs`), and [`Life`], the gate that lets the sweep reclaim a record
//! writers add to without a lock.
//!
//! A reference obtained from a directory is bound to the caller's epoch guard: an unlinked
//! record is freed only after every guard pinned before its unlink. A directory is a hash table
//! of bucket lists read wait-free under an epoch guard; writers link and unlink records under a
//! mutex in O(1) amortized (see [`Directory`]).

use crate::sync::{AtomicU64, Mutex, Ordering};
use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned};
use std::sync::Arc;

/// Hash of a tuple of strings (no allocation).
///
/// Each string is hashed on its own, seeded by its position (so `("a", "b")` and `("b", "a")`
/// differ), and the hashes are folded with a multiply: the strings' hashes do not wait for one
/// another, which took a partition lookup's four names from a chain of four dependent xxh3
/// calls to about the latency of one.
#[inline]
pub(crate) fn hash_strs(parts: &[&str]) -> u64 {
    const FOLD: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = 0x5158_4b5a_u64;
    for (position, p) in parts.iter().enumerate() {
        let x = xxhash_rust::xxh3::xxh3_64_with_seed(p.as_bytes(), position as u64);
        h = (h ^ x).wrapping_mul(FOLD).rotate_left(31);
    }
    h
}

/// String equality for the directory's names, which are short (tenant, model, scheme, adapter):
/// lengths first, then 8-byte words, inline. `==` on `str` calls `memcmp`, whose call and setup
/// were ~1/5 of a W1M `lookup_route` in a profile (the partition lookup compares four names);
/// this form took W1M Q50's `lookup_route_into` from ~505 to ~385 ns in alternating runs.
#[inline]
pub(crate) fn same_str(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        if x != y {
            return false;
        }
    }
    let (ra, rb) = (ca.remainder(), cb.remainder());
    let mut i = 0;
    while i < ra.len() {
        if ra[i] != rb[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// A value with an empty form that lives for the whole program: what an [`Rcu`] that holds no
/// allocation reads as.
pub(crate) trait StaticEmpty: 'static {
    /// The empty value.
    const EMPTY: &'static Self;
}

impl<T: 'static> StaticEmpty for Vec<T> {
    const EMPTY: &'static Self = &Vec::new();
}

/// A read-copy-update cell: wait-free reads, writers copy and swap under a mutex.
///
/// A cell that was never written holds no allocation (null) and reads as [`StaticEmpty::EMPTY`]:
/// every (tenant, model) pair has one for its stats records and most pairs never get one
/// (issue 42's churned tenants: a boxed empty vector each). The writer lock may guard data of
/// the owner's as well (`G`: a pair's list of partitions), so the owner carries one lock, not
/// two (each a byte padded to a word).
pub(crate) struct Rcu<T: StaticEmpty, G = ()> {
    cur: Atomic<T>,
    /// Writer lock, with the data it guards besides the cell.
    lock: Mutex<G>,
}

impl<T: StaticEmpty, G> Rcu<T, G> {
    /// An empty cell (no allocation until the first write) whose lock guards `guarded`.
    pub(crate) fn empty_with(guarded: G) -> Self {
        Self {
            cur: Atomic::null(),
            lock: Mutex::new(guarded),
        }
    }

    /// The data the writer lock guards besides the cell, locked (not to be held across an
    /// [`update`](Rcu::update) of the same cell: the lock is not reentrant).
    pub(crate) fn guarded(&self) -> crate::sync::MutexGuard<'_, G> {
        self.lock.lock()
    }

    /// The current value.
    #[inline]
    pub(crate) fn load<'g>(&self, guard: &'g Guard) -> &'g T {
        // SAFETY: null (never written: the static empty value) or a value published with
        // Release (loaded with Acquire); old values are retired through the epoch, so they
        // outlive `guard`.
        unsafe { self.cur.load(Ordering::Acquire, guard).as_ref() }.unwrap_or(T::EMPTY)
    }

    /// Runs `f` on the current value under the writer lock; `Some(new)` replaces it.
    pub(crate) fn update<R>(&self, f: impl FnOnce(&T) -> (Option<T>, R)) -> R {
        let _l = self.lock.lock();
        let guard = epoch::pin();
        let old = self.cur.load(Ordering::Acquire, &guard);
        // SAFETY: as in `load`; we hold the writer lock so it is the current value.
        let (new, r) = f(unsafe { old.as_ref() }.unwrap_or(T::EMPTY));
        if let Some(new) = new {
            self.cur.store(Owned::new(new), Ordering::Release);
            if !old.is_null() {
                // SAFETY: `old` is unlinked; readers may hold it until their guard drops.
                unsafe { guard.defer_destroy(old) };
            }
        }
        r
    }
}

impl<T: StaticEmpty, G> Drop for Rcu<T, G> {
    fn drop(&mut self) {
        // SAFETY: exclusive access; the current value is owned by the cell.
        unsafe {
            let g = epoch::unprotected();
            let p = self.cur.load(Ordering::Relaxed, g);
            if !p.is_null() {
                drop(p.into_owned());
            }
        }
    }
}

/// One record of a [`Directory`], in its bucket's list.
/// Bytes of one directory node (its hash, link and record reference), for the memory
/// accounting.
pub(crate) const DIRECTORY_NODE_BYTES: usize = std::mem::size_of::<DirectoryNode<()>>();

struct DirectoryNode<T> {
    hash: u64,
    rec: Arc<T>,
    next: Atomic<DirectoryNode<T>>,
}

/// A [`Directory`]'s bucket array (a power of two long), published whole.
struct DirectoryTable<T> {
    buckets: Box<[Atomic<DirectoryNode<T>>]>,
}

impl<T> DirectoryTable<T> {
    fn with_buckets(n: usize) -> Self {
        Self {
            buckets: (0..n).map(|_| Atomic::null()).collect(),
        }
    }

    #[inline]
    fn bucket(&self, h: u64) -> &Atomic<DirectoryNode<T>> {
        // Lengths are powers of two; the hash is xxh3's, whose low bits are as good as any.
        &self.buckets[(h as usize) & (self.buckets.len() - 1)]
    }
}

/// Buckets of a new directory (and the fewest a shrinking one keeps). Small, because every
/// scope has a directory of its replicas, most of them with a handful.
const DIRECTORY_MIN_BUCKETS: usize = 2;

/// A directory of records keyed by a string-tuple hash: a hash table of singly linked bucket
/// lists, read wait-free under an epoch guard, written under one mutex.
///
/// Invariants: a linked node is never changed except for its `next` link when the node after
/// it is unlinked; an insertion links a fully built node at the head of its bucket (Release),
/// so a reader that loads a link (Acquire) sees the whole node, and an unlinked node keeps its
/// own `next`, so a reader standing on it still reaches the rest of the list. Unlinked nodes
/// are freed through the epoch. When the records outnumber the buckets (or fall below an
/// eighth of them), the writer builds a table of twice (half) as many buckets with new nodes
/// (each holding another `Arc` of its record), publishes it (Release) and retires the old
/// table and its nodes through the epoch: a reader still on the old table reads valid nodes.
/// So an insertion or removal costs O(1) amortized (the copy that made every new record cost
/// O(records) is gone), and a record reached under a guard lives at least as long as the
/// guard: the `Arc`s of every table version it is linked in are dropped after it.
pub(crate) struct Directory<T> {
    table: Atomic<DirectoryTable<T>>,
    /// Writer lock and the number of records.
    lock: Mutex<usize>,
}

impl<T> Directory<T> {
    pub(crate) fn new() -> Self {
        Self {
            table: Atomic::new(DirectoryTable::with_buckets(DIRECTORY_MIN_BUCKETS)),
            lock: Mutex::new(0),
        }
    }

    #[inline]
    fn table<'g>(&self, guard: &'g Guard) -> &'g DirectoryTable<T> {
        // SAFETY: never null (set in `new`, replaced only by non-null tables); old tables are
        // retired through the epoch, so they outlive `guard`.
        unsafe { self.table.load(Ordering::Acquire, guard).deref() }
    }

    /// The record with hash `h` satisfying `pred`, in the table current under `guard`.
    #[inline]
    fn find<'g>(&self, h: u64, pred: impl Fn(&T) -> bool, guard: &'g Guard) -> Option<&'g Arc<T>> {
        let mut cur = self.table(guard).bucket(h).load(Ordering::Acquire, guard);
        // SAFETY: linked nodes are complete (published with Release, loaded with Acquire) and
        // retired only through the epoch, after `guard`'s pin.
        while let Some(n) = unsafe { cur.as_ref() } {
            if n.hash == h && pred(&n.rec) {
                return Some(&n.rec);
            }
            cur = n.next.load(Ordering::Acquire, guard);
        }
        None
    }

    /// Finds the record with hash `h` satisfying `pred`. Wait-free. The record stays valid
    /// while `guard` is pinned: a removed record's last directory reference is dropped
    /// through the epoch (see [`Directory::remove`]).
    #[inline]
    pub(crate) fn get<'g>(
        &self,
        h: u64,
        pred: impl Fn(&T) -> bool,
        guard: &'g Guard,
    ) -> Option<&'g T> {
        self.find(h, pred, guard).map(|r| &**r)
    }

    /// Unlinks the record `rec` (hash `h`) if present; returns whether it was. Readers pinned
    /// before the unlink may still hold the node and the record: both are freed (the node,
    /// with its `Arc`) through the epoch. A directory whose records fall below an eighth of
    /// its buckets is rebuilt at half the size, so buckets follow the records down too.
    pub(crate) fn remove(&self, h: u64, rec: *const T) -> bool {
        let mut count = self.lock.lock();
        let guard = epoch::pin();
        // SAFETY: non-null (see `table`); we hold the writer lock, so it is the current table.
        let table = unsafe { self.table.load(Ordering::Acquire, &guard).deref() };
        let mut link = table.bucket(h);
        loop {
            let cur = link.load(Ordering::Acquire, &guard);
            // SAFETY: as in `find`; only this (locked) writer unlinks nodes.
            let Some(n) = (unsafe { cur.as_ref() }) else {
                return false;
            };
            if std::ptr::eq(Arc::as_ptr(&n.rec), rec) {
                // Readers standing on `n` still follow its (unchanged) `next`.
                link.store(n.next.load(Ordering::Acquire, &guard), Ordering::Release);
                // SAFETY: unlinked; readers may hold it until their guards drop.
                unsafe { guard.defer_destroy(cur) };
                break;
            }
            link = &n.next;
        }
        *count -= 1;
        if *count * 8 < table.buckets.len() && table.buckets.len() > DIRECTORY_MIN_BUCKETS {
            self.rebuild(table.buckets.len() / 2, &guard);
        }
        true
    }

    /// Publishes a copy of the current table with `buckets` buckets and retires the old one
    /// with its nodes (writer lock held).
    fn rebuild(&self, buckets: usize, guard: &Guard) {
        let shared = self.table.load(Ordering::Acquire, guard);
        // SAFETY: non-null, current (writer lock held).
        let table = unsafe { shared.deref() };
        let grown = DirectoryTable::with_buckets(buckets);
        for b in table.buckets.iter() {
            let mut cur = b.load(Ordering::Acquire, guard);
            // SAFETY: as in `find`; only this (locked) writer links nodes.
            while let Some(n) = unsafe { cur.as_ref() } {
                Self::link(&grown, n.hash, n.rec.clone(), guard);
                cur = n.next.load(Ordering::Acquire, guard);
            }
        }
        self.table.store(Owned::new(grown), Ordering::Release);
        // SAFETY: the old table is unlinked; readers may hold it (and its nodes) until their
        // guards drop, and the destructor below runs after that.
        unsafe {
            guard.defer_unchecked(move || {
                let old = shared.into_owned();
                Self::free_nodes(&old);
            });
        }
        // The old table's nodes hold a reference to every record it listed: handed to the
        // collector now, not when this thread's bag fills. A writer thread that rebuilds a
        // directory and then goes quiet (a producer's connection after a churn wave) would
        // otherwise keep every record of the old table alive, records the sweep reclaimed
        // included, for as long as it defers nothing else (issue 42). Rebuilds are rare (the
        // size doubles or halves), so the flush costs nothing measurable.
        guard.flush();
    }

    /// Records in the directory.
    pub(crate) fn len(&self) -> usize {
        *self.lock.lock()
    }

    /// Finds or creates a record; returns it and whether it was created.
    pub(crate) fn get_or_insert(
        &self,
        h: u64,
        pred: impl Fn(&T) -> bool,
        make: impl FnOnce() -> Arc<T>,
    ) -> (Arc<T>, bool) {
        if let Some(r) = self.get_arc(h, &pred) {
            return (r, false);
        }
        let mut count = self.lock.lock();
        let guard = epoch::pin();
        if let Some(r) = self.find(h, &pred, &guard) {
            return (r.clone(), false);
        }
        let rec = make();
        // SAFETY: non-null (see `table`); we hold the writer lock, so it is the current table.
        let buckets = unsafe { self.table.load(Ordering::Acquire, &guard).deref() }
            .buckets
            .len();
        if *count + 1 > buckets {
            self.rebuild(buckets * 2, &guard);
        }
        Self::link(self.table(&guard), h, rec.clone(), &guard);
        *count += 1;
        (rec, true)
    }

    /// Links a new node at the head of its bucket in `table` (writer lock held, or `table` not
    /// yet published).
    fn link(table: &DirectoryTable<T>, h: u64, rec: Arc<T>, guard: &Guard) {
        let bucket = table.bucket(h);
        let node = Owned::new(DirectoryNode {
            hash: h,
            rec,
            next: Atomic::null(),
        });
        node.next
            .store(bucket.load(Ordering::Relaxed, guard), Ordering::Relaxed);
        bucket.store(node, Ordering::Release);
    }

    /// Frees the nodes of a table no reader can reach.
    fn free_nodes(table: &DirectoryTable<T>) {
        // SAFETY: the caller owns the table exclusively (unlinked and past its epoch, or the
        // directory is being dropped).
        unsafe {
            let g = epoch::unprotected();
            for b in table.buckets.iter() {
                let mut cur = b.load(Ordering::Relaxed, g);
                while !cur.is_null() {
                    let node = cur.into_owned();
                    cur = node.next.load(Ordering::Relaxed, g);
                    drop(node);
                }
            }
        }
    }

    pub(crate) fn get_arc(&self, h: u64, pred: &impl Fn(&T) -> bool) -> Option<Arc<T>> {
        let guard = epoch::pin();
        self.find(h, pred, &guard).cloned()
    }

    /// Every record (writer-side / aggregate use; allocates).
    pub(crate) fn all(&self) -> Vec<Arc<T>> {
        let guard = epoch::pin();
        let mut out = Vec::new();
        for b in self.table(&guard).buckets.iter() {
            let mut cur = b.load(Ordering::Acquire, &guard);
            // SAFETY: as in `find`.
            while let Some(n) = unsafe { cur.as_ref() } {
                out.push(n.rec.clone());
                cur = n.next.load(Ordering::Acquire, &guard);
            }
        }
        out
    }
}

impl<T> Drop for Directory<T> {
    fn drop(&mut self) {
        // SAFETY: exclusive access; the current table is owned by the directory (older ones
        // were handed to the epoch with their nodes).
        unsafe {
            let g = epoch::unprotected();
            let p = self.table.load(Ordering::Relaxed, g);
            if !p.is_null() {
                let t = p.into_owned();
                Self::free_nodes(&t);
            }
        }
    }
}

/// Set in a [`Life`] word once its record is retired.
const DEAD: u64 = 1 << 63;

/// The reclamation gate of a record that writers add to without holding the directory lock
/// (a partition's entries, a (tenant, model) pair's stats, a scope slot's replica): writers
/// [`enter`](Life::enter) before they write and [`exit`](Life::exit) after their last counter
/// update; the sweep retires a record only by swapping 0 writers for [`DEAD`].
///
/// Protocol: a writer's `enter` fails on a retired record, and it resolves the record again
/// under the index's record lock (finding the successor, or creating one). The sweep checks
/// emptiness *after* `try_retire` succeeded: the swap read the count left by the last
/// writer's `exit` (Release), so every counter update of every writer that got in is visible
/// to it, and no writer can get in afterwards. If the record turns out not to be empty, the
/// sweep [`revive`](Life::revive)s it. Removals need no gate: they only ever lower counters,
/// which the sweep reads after theirs were applied or sees too high (and then keeps the
/// record).
pub(crate) struct Life(AtomicU64);

impl Life {
    pub(crate) fn new() -> Self {
        Self(AtomicU64::new(0))
    }

    /// Registers a writer; false if the record is retired.
    #[inline]
    pub(crate) fn enter(&self) -> bool {
        let mut cur = self.0.load(Ordering::Relaxed);
        loop {
            if cur & DEAD != 0 {
                return false;
            }
            match self
                .0
                .compare_exchange_weak(cur, cur + 1, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    /// Ends a writer's [`Life::enter`]: its counter updates happen before a later retirement.
    #[inline]
    pub(crate) fn exit(&self) {
        self.0.fetch_sub(1, Ordering::Release);
    }

    /// Retires the record if no writer is in (sweep, record lock held).
    pub(crate) fn try_retire(&self) -> bool {
        self.0
            .compare_exchange(0, DEAD, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    /// Undoes a [`Life::try_retire`] whose record was not empty after all.
    pub(crate) fn revive(&self) {
        self.0.store(0, Ordering::Release);
    }

    /// Whether the record was retired.
    pub(crate) fn is_dead(&self) -> bool {
        self.0.load(Ordering::Acquire) & DEAD != 0
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// `same_str` is `==`: every length up to 24, a difference at every position.
    #[test]
    fn same_str_is_string_equality() {
        let base = "abcdefghijklmnopqrstuvwx";
        for n in 0..=base.len() {
            let a = &base[..n];
            assert!(same_str(a, &String::from(a)));
            for m in 0..=base.len() {
                assert_eq!(same_str(a, &base[..m]), n == m, "{n} vs {m}");
            }
            for i in 0..n {
                let mut b = a.as_bytes().to_vec();
                b[i] = b'#';
                let b = String::from_utf8(b).unwrap();
                assert!(!same_str(a, &b), "{a:?} vs {b:?}");
            }
        }
    }
}
