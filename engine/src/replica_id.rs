//! Replica ids as lookups return them: interned, reference-counted handles.
//!
//! A LookupRoute names every replica it ranks, and the index compares ids all the time (stats
//! records against scope replicas, holders' replicas against results). An id is one
//! process-wide copy of its text, shared by every record and result that names it, so
//! comparing two ids compares two pointers.
//!
//! # Lifetime
//!
//! An id is interned when an index first names it (a scope's new replica, a stats report) and
//! counted by every handle: the scope slot and the stats records that name it, and any result
//! a caller still holds. The last handle's drop frees the text and takes it out of the
//! interner, so a fleet that renames its pods at every rollout keeps only the ids that some
//! record or result still names (the records go once they hold nothing, `index/records.rs`).
//!
//! Invariants: the interner maps a text to its live copy (count ≥ 1) or to a dying one (count
//! 0, its last handle being dropped); it never hands out a dying copy (a count is only raised
//! from ≥ 1, under the interner's lock), so two live handles with the same text are the same
//! copy and pointer equality is text equality. A dying copy is freed by the thread that
//! dropped it to 0, after taking it out of the interner if it is still the one mapped (an
//! `intern` may have replaced it meanwhile).
//!
//! Lookups build their rankings from [`BorrowedId`]s (no count touched), valid while the
//! lookup's epoch guard keeps the scope slot naming them, and count only the ids they return.

use crate::sync::{GlobalMutex, GlobalMutexGuard};
use std::collections::HashSet;
use std::ptr::NonNull;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering, fence};

/// One interned id.
struct Name {
    refs: AtomicUsize,
    text: Box<str>,
}

/// The interner's entry for a [`Name`]: hashed and compared by text (so the set is looked up
/// by `&str`).
struct Entry(NonNull<Name>);

// SAFETY: an entry only names a `Name` (immutable text, atomic count) that outlives it in the
// set: a name is freed only after it was taken out of the set, under the set's lock.
unsafe impl Send for Entry {}

impl Entry {
    fn text(&self) -> &str {
        // SAFETY: see `Send`: a name in the set is not freed.
        unsafe { &self.0.as_ref().text }
    }
}

impl std::hash::Hash for Entry {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.text().hash(state);
    }
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.text() == other.text()
    }
}

impl Eq for Entry {}

impl std::borrow::Borrow<str> for Entry {
    fn borrow(&self) -> &str {
        self.text()
    }
}

/// The interned ids. Not a loom lock even in loom builds (a static outlives every model):
/// interning runs on the writer paths that create records and dropping on the paths that free
/// them; it holds the lock only for a set lookup, insert or removal (no loom operation inside)
/// and orders nothing the models check.
static NAMES: OnceLock<GlobalMutex<HashSet<Entry>>> = OnceLock::new();

fn names() -> GlobalMutexGuard<'static, HashSet<Entry>> {
    NAMES.get_or_init(Default::default).lock()
}

/// A replica id: derefs to the id's text; equality, ordering and hashing are the text's.
/// (Equality compares the pointers: the interner keeps one live copy per text.) Cloning and
/// dropping count the copy's handles (see the module docs).
pub struct ReplicaId(NonNull<Name>);

// SAFETY: a handle names immutable text and an atomic count; the count keeps the text alive.
unsafe impl Send for ReplicaId {}
// SAFETY: as for `Send`: `&ReplicaId` only reads the text or raises the count atomically.
unsafe impl Sync for ReplicaId {}

impl PartialEq for ReplicaId {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl Eq for ReplicaId {}

impl PartialOrd for ReplicaId {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ReplicaId {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl std::hash::Hash for ReplicaId {
    /// The text's hash (as `Borrow<str>` requires: maps keyed by ids are looked up by `&str`).
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl Clone for ReplicaId {
    #[inline]
    fn clone(&self) -> Self {
        // Relaxed, as `Arc`: a new handle is made from an existing one, which keeps the copy
        // alive meanwhile.
        // SAFETY: `self` is a live handle, so the name is alive.
        let old = unsafe { self.0.as_ref() }
            .refs
            .fetch_add(1, Ordering::Relaxed);
        if old > isize::MAX as usize {
            std::process::abort();
        }
        ReplicaId(self.0)
    }
}

impl Drop for ReplicaId {
    /// Inline, as every returned score drops one: the decrement here, the rare free of the
    /// last handle out of line.
    #[inline]
    fn drop(&mut self) {
        // SAFETY: `self` is a live handle until this decrement.
        if unsafe { self.0.as_ref() }
            .refs
            .fetch_sub(1, Ordering::Release)
            == 1
        {
            self.free();
        }
    }
}

impl ReplicaId {
    /// Frees the copy whose count this handle just took to 0.
    #[cold]
    #[inline(never)]
    fn free(&mut self) {
        // Every other handle's uses happen before the free (their decrements were Release).
        fence(Ordering::Acquire);
        let mut set = names();
        // SAFETY: count 0: no handle is left and `intern` never revives a dying copy, so only
        // this thread reaches the name (the set's entry, if it is still this one, is removed
        // under the lock before the free).
        let text: &str = unsafe { &self.0.as_ref().text };
        if set.get(text).is_some_and(|e| e.0 == self.0) {
            set.remove(text);
        }
        drop(set);
        // SAFETY: allocated by `Box::new` in `intern`; unreachable now (see above).
        drop(unsafe { Box::from_raw(self.0.as_ptr()) });
    }

    /// A handle of the interned copy of `id` (created on first use).
    pub fn intern(id: &str) -> Self {
        let mut set = names();
        if let Some(e) = set.get(id) {
            // SAFETY: a name in the set is not freed while the lock is held.
            let name = unsafe { e.0.as_ref() };
            let mut refs = name.refs.load(Ordering::Relaxed);
            while refs > 0 {
                match name.refs.compare_exchange_weak(
                    refs,
                    refs + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => return ReplicaId(e.0),
                    Err(now) => refs = now,
                }
            }
            // Dying: its last handle is being dropped. A new copy takes its place (the dying
            // one's thread sees it replaced and leaves the set alone).
            set.remove(id);
        }
        let name = NonNull::from(Box::leak(Box::new(Name {
            refs: AtomicUsize::new(1),
            text: id.into(),
        })));
        set.insert(Entry(name));
        ReplicaId(name)
    }

    /// The id's text.
    #[inline]
    pub fn as_str(&self) -> &str {
        // SAFETY: a live handle keeps its name alive.
        unsafe { &self.0.as_ref().text }
    }

    /// The id, borrowed (see [`BorrowedId`]).
    #[inline]
    pub(crate) fn borrow_id(&self) -> BorrowedId {
        BorrowedId(self.0)
    }

    /// Ids interned and not yet freed, process-wide (diagnostics and tests).
    pub fn interned() -> usize {
        names().len()
    }
}

/// An id named by a record the caller can reach under its epoch guard, without a counted
/// handle (rankings hold one per candidate replica; only what a lookup returns is counted).
///
/// Contract: used only while the record it was taken from (a scope slot) is reachable by the
/// caller, i.e. within the guard under which it was read; a lookup's scratch entries are
/// cleared before the next lookup reuses them.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct BorrowedId(NonNull<Name>);

// SAFETY: a borrowed id is only dereferenced within its contract (see above), on whichever
// thread holds the scratch it lives in; sending the scratch between lookups sends nothing live.
unsafe impl Send for BorrowedId {}
// SAFETY: as for `Send`; shared access only reads the text within the contract.
unsafe impl Sync for BorrowedId {}

impl BorrowedId {
    /// The id's text.
    ///
    /// # Safety
    /// Within the contract of [`BorrowedId`].
    #[inline]
    pub(crate) unsafe fn as_str<'a>(self) -> &'a str {
        // SAFETY: per the contract, a record holding a counted handle is reachable.
        unsafe { &(*self.0.as_ptr()).text }
    }

    /// A counted handle of the id.
    ///
    /// # Safety
    /// Within the contract of [`BorrowedId`].
    #[inline]
    pub(crate) unsafe fn to_owned(self) -> ReplicaId {
        // SAFETY: per the contract the name is alive (a record holds a handle); the new
        // handle is then counted like any clone.
        let name = unsafe { self.0.as_ref() };
        let old = name.refs.fetch_add(1, Ordering::Relaxed);
        if old > isize::MAX as usize {
            std::process::abort();
        }
        ReplicaId(self.0)
    }
}

impl std::ops::Deref for ReplicaId {
    type Target = str;
    #[inline]
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for ReplicaId {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl std::borrow::Borrow<str> for ReplicaId {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl From<&str> for ReplicaId {
    fn from(id: &str) -> Self {
        ReplicaId::intern(id)
    }
}

impl PartialEq<str> for ReplicaId {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for ReplicaId {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl std::fmt::Debug for ReplicaId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

impl std::fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Interned ids starting with `prefix` (tests: the interner is process-wide, and tests run in
/// parallel, so each counts its own ids).
#[cfg(all(test, not(loom)))]
pub(crate) fn interned_with_prefix(prefix: &str) -> usize {
    names()
        .iter()
        .filter(|e| e.text().starts_with(prefix))
        .count()
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn interning_keeps_one_copy_per_text() {
        let a = ReplicaId::intern("pod-a");
        let b = ReplicaId::intern(&String::from("pod-a"));
        let c = ReplicaId::intern("pod-b");
        assert!(std::ptr::eq(a.as_str(), b.as_str()), "one copy per text");
        assert_eq!(a, b);
        assert_ne!(a, c);
        // Same address, different length: a prefix is a different id.
        let ab = ReplicaId::intern("pod-ab");
        let a_of_ab = ReplicaId::intern(&ab[..5]);
        assert_ne!(a_of_ab, ab);
        assert_eq!(a_of_ab, a);
        assert!(a < c, "ordered as text");
        assert_eq!(&*a, "pod-a");
        assert_eq!(a, "pod-a");
        assert_eq!(format!("{a}/{a:?}"), "pod-a/\"pod-a\"");
        assert_eq!(ReplicaId::intern("").as_str(), "");
    }

    fn alive(prefix: &str) -> usize {
        interned_with_prefix(prefix)
    }

    /// A fleet that renames its pods forever: more than 2^20 distinct ids over time, at most
    /// 64 named at once. Every id goes with its last handle, so the interner holds at most the
    /// 64.
    #[test]
    fn ids_are_freed_with_their_last_handle() {
        let mut fleet: Vec<ReplicaId> = Vec::new();
        for k in 0..(1usize << 20) + 4096 {
            let id = ReplicaId::intern(&format!("renamed-pod-{k:08x}"));
            let again = id.clone();
            assert_eq!(id, again);
            if fleet.len() == 64 {
                fleet.remove(k % 64);
            }
            fleet.push(again);
            drop(id);
            if k % 65_536 == 0 {
                assert!(alive("renamed-pod-") <= 64, "round {k}");
            }
        }
        assert_eq!(alive("renamed-pod-"), 64);
        // Re-interning a live id gives the same copy; an id whose handles all went is a new
        // copy with the same text.
        let kept = fleet[0].clone();
        assert!(std::ptr::eq(
            ReplicaId::intern(kept.as_str()).as_str(),
            kept.as_str()
        ));
        fleet.clear();
        assert_eq!(alive("renamed-pod-"), 1, "only the handle still held");
        drop(kept);
        assert_eq!(alive("renamed-pod-"), 0);
    }

    /// Threads interning and dropping the same few ids at once: every handle of a text is the
    /// same copy while any is alive, and nothing is left once all are dropped.
    #[test]
    fn concurrent_interning_and_dropping_keep_one_copy_per_text() {
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for k in 0..20_000usize {
                        let text = format!("racing-pod-{}", (k + t) % 3);
                        let a = ReplicaId::intern(&text);
                        let b = ReplicaId::intern(&text);
                        assert_eq!(a, b, "one live copy per text");
                        assert_eq!(a.as_str(), text);
                    }
                });
            }
        });
        assert_eq!(alive("racing-pod-"), 0);
    }
}
