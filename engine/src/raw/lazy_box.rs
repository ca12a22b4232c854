//! A box made on first use and published once: one pointer inline, null until a caller needs
//! the value, never replaced, freed with its owner.
//!
//! Records that most identities never use in full (a tenant's quota hand, a partition's LFU
//! writer side) keep such a pointer instead of the value itself, so an identity that never
//! needs it pays 8 bytes. The maker builds the box completely, then publishes its address with
//! a Release compare-exchange; readers load it with Acquire, so whoever sees the address sees
//! the box's contents. Two racing makers both build a box; the loser frees its own, which was
//! never shared, and uses the winner's. The box is freed only in `drop` (`&mut self`), after
//! every reader is gone.

use std::marker::PhantomData;

use crate::sync::{AtomicPtr, Ordering};

/// A `T` made on first use (see the module documentation).
pub(crate) struct LazyBox<T> {
    pointer: AtomicPtr<T>,
    /// Owns the box: dropping a `LazyBox<T>` drops a `T`.
    owns: PhantomData<Box<T>>,
}

impl<T> LazyBox<T> {
    /// An empty box (a null pointer).
    pub(crate) fn new() -> Self {
        Self {
            pointer: AtomicPtr::new(std::ptr::null_mut()),
            owns: PhantomData,
        }
    }

    /// The value, if it was ever made.
    pub(crate) fn get(&self) -> Option<&T> {
        // Acquire: pairs with the Release compare-exchange that published the built box.
        let value = self.pointer.load(Ordering::Acquire);
        // SAFETY: a non-null pointer is a box published fully built and freed only in `drop`
        // (`&mut self`), so it outlives `&self`.
        unsafe { value.as_ref() }
    }

    /// The value, made by `make` if absent (a racing maker's value wins; this one is dropped).
    pub(crate) fn get_or_make(&self, make: impl FnOnce() -> T) -> &T {
        if let Some(value) = self.get() {
            return value;
        }
        let fresh = Box::into_raw(Box::new(make()));
        // Release: the box's contents before its address (AcqRel: on failure, Acquire reads
        // the winner's box).
        match self.pointer.compare_exchange(
            std::ptr::null_mut(),
            fresh,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            // SAFETY: published just now, freed only in `drop`.
            Ok(_) => unsafe { &*fresh },
            Err(winner) => {
                // SAFETY: `fresh` was never published: this thread owns it.
                drop(unsafe { Box::from_raw(fresh) });
                // SAFETY: as in `get`: the winner's box, published fully built.
                unsafe { &*winner }
            }
        }
    }

    /// The value, if it was ever made, for the owner alone.
    pub(crate) fn get_mut(&mut self) -> Option<&mut T> {
        let value = self.pointer.load(Ordering::Relaxed);
        // SAFETY: `&mut self`: nothing else reaches the box, made by `get_or_make`.
        unsafe { value.as_mut() }
    }
}

impl<T> Drop for LazyBox<T> {
    fn drop(&mut self) {
        let value = self.pointer.load(Ordering::Relaxed);
        if !value.is_null() {
            // SAFETY: `&mut self`: nothing else reaches the box, made by `get_or_make`.
            drop(unsafe { Box::from_raw(value) });
        }
    }
}

// SAFETY: the box is made on one thread and may be dropped on another (`T: Send`).
unsafe impl<T: Send> Send for LazyBox<T> {}
// SAFETY: `&LazyBox<T>` hands out `&T` to any thread (`T: Sync`) and lets any thread make the
// value that another later drops (`T: Send`).
unsafe impl<T: Send + Sync> Sync for LazyBox<T> {}
