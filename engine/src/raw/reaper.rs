//! Retired objects whose grace period has passed, waiting for a writer to free them.
//!
//! An object retired through the epoch is freed by whichever thread collects the garbage,
//! often a reader inside a lookup, and freeing memory another thread allocated is slow under
//! glibc (it takes the allocating arena's lock once the reader's cache of free chunks is full):
//! with one writer at 1 M blocks/s, 0.5% of a reader's lookups paid ~630 ns for it, which is
//! P7's p99. So the epoch's deferred function does not free the object: it pushes it onto a
//! [`Reaper`], and the structure's writers free what is there whenever one takes its lock. One
//! reaper may serve several structures (an index's partitions share one,
//! `RunStore::with_reaper`): a writer of any of them frees what all of them retired, since a
//! retired object is freed alone, without its structure.
//!
//! The reaper is a lock-free stack linked through a word each object lends it once retired
//! ([`Reclaim::link`]: a retired object has no references left, so its reference word is free).
//! [`Reaper::push`] is a compare-and-swap loop on the head; [`Reaper::free_all`] takes the
//! whole stack with one swap, so no object is ever popped alone and the stack has no ABA
//! problem. Dropping the reaper frees what it holds; each deferred push owns a reference to it,
//! so a structure dropped with pushes pending leaves them a reaper to push to. Loom m11 checks
//! the stack.

use crate::sync::{AtomicPtr, AtomicU64, Ordering};

/// An object a [`Reaper`] can hold and free.
pub trait Reclaim {
    /// The word the object lends the stack as its link once retired.
    fn link(&self) -> &AtomicU64;

    /// Frees the object.
    ///
    /// # Safety
    /// `p` was retired once, its grace period has passed, and nothing else holds it.
    unsafe fn reclaim(p: *mut Self);
}

/// A stack of retired objects (see the module docs).
pub struct Reaper<T: Reclaim> {
    head: AtomicPtr<T>,
}

impl<T: Reclaim> Default for Reaper<T> {
    fn default() -> Self {
        Self {
            head: AtomicPtr::new(std::ptr::null_mut()),
        }
    }
}

impl<T: Reclaim> Reaper<T> {
    /// Adds a retired object (called from its epoch-deferred function).
    ///
    /// # Safety
    /// `object` is live, was retired once, its grace period has passed and nothing else will
    /// reach it: the stack owns it from here on.
    pub unsafe fn push(&self, object: *mut T) {
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            // SAFETY: the object is retired and its grace period has passed: only this stack
            // will reach it, and its link word is the stack's from here on.
            unsafe { (*object).link().store(head as u64, Ordering::Relaxed) };
            // Release: the link is written before the object is published on the stack.
            match self.head.compare_exchange_weak(
                head,
                object,
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(h) => head = h,
            }
        }
    }

    /// Whether no retired object waits.
    pub fn is_empty(&self) -> bool {
        self.head.load(Ordering::Relaxed).is_null()
    }

    /// Frees every object on the stack; returns how many. One load when it is empty.
    pub fn free_all(&self) -> usize {
        if self.is_empty() {
            return 0;
        }
        // Acquire: synchronizes with every push whose object is on the stack. Each push's
        // compare-and-swap is a Release that heads a release sequence, and the later pushes'
        // compare-and-swaps (read-modify-writes) continue it, so the value this swap reads
        // carries all of them: their links, and through each deferred function the epoch's
        // guarantee that every reader's last access to its object happened before it.
        let mut p = self.head.swap(std::ptr::null_mut(), Ordering::Acquire);
        let mut n = 0;
        while !p.is_null() {
            // SAFETY: taken off the stack by the swap, so this thread owns every object of the
            // list; each was retired once and pushed once.
            let next = unsafe { (*p).link().load(Ordering::Relaxed) } as usize as *mut T;
            // SAFETY: as above; no reader can reach it (its grace period has passed).
            unsafe { T::reclaim(p) };
            p = next;
            n += 1;
        }
        n
    }
}

impl<T: Reclaim> Drop for Reaper<T> {
    fn drop(&mut self) {
        self.free_all();
    }
}
