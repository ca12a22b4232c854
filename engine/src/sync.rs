//! Concurrency seam: every lock of the engine, its own atomics and the thread-local macro come
//! from here, so that a `--cfg loom` build swaps in loom's instrumented types (see
//! `loom-tests/`). A normal build re-exports the std / parking_lot items unchanged.
//!
//! The locks keep parking_lot's API in both builds (no poisoning, `wait_for` on a guard borrowed
//! mutably): under loom, thin wrappers adapt loom's std-shaped types to it. One lock is outside
//! loom on purpose: [`GlobalMutex`], for process-wide statics, which outlive every loom model
//! (loom objects belong to one execution). `engine/tests/lock_family.rs` checks that no other
//! engine file names a lock of its own.
//!
//! Under loom, crossbeam-epoch must be built with `--cfg crossbeam_loom` (and its `loom`
//! feature, which `engine/Cargo.toml` enables for `cfg(loom)` builds only) so that pinning,
//! retirement and collection are loom-visible too.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicI64, AtomicPtr, AtomicU64};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicI64, AtomicPtr, AtomicU64};

pub(crate) use std::sync::atomic::Ordering;

/// A lock for process-wide statics: parking_lot's in every build. A loom lock cannot live in a
/// static (it belongs to one model execution), so what it guards must order nothing a loom
/// model checks (see its users).
pub(crate) use parking_lot::{Mutex as GlobalMutex, MutexGuard as GlobalMutexGuard};

#[cfg(not(loom))]
pub(crate) use parking_lot::{Condvar, Mutex, MutexGuard, RwLock};
#[cfg(not(loom))]
pub(crate) use std::thread_local;

#[cfg(loom)]
pub(crate) use loom::thread_local;

/// Loom build: a loom mutex with parking_lot's `lock()` signature (no poisoning in the API).
#[cfg(loom)]
pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

#[cfg(loom)]
impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(loom::sync::Mutex::new(value))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        MutexGuard(Some(self.0.lock().expect("loom mutex poisoned")))
    }

    pub(crate) fn get_mut(&mut self) -> &mut T {
        self.0.get_mut().expect("loom mutex poisoned")
    }
}

/// Loom build: the guard of a [`Mutex`]. Loom's condition variable takes its guard by value
/// while parking_lot's borrows it, so the guard sits in an `Option` that [`Condvar::wait_for`]
/// empties for the wait and refills; it is `Some` at every other moment.
#[cfg(loom)]
pub(crate) struct MutexGuard<'a, T>(Option<loom::sync::MutexGuard<'a, T>>);

#[cfg(loom)]
impl<T> std::ops::Deref for MutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.0
            .as_deref()
            .expect("a guard holds its lock outside a wait")
    }
}

#[cfg(loom)]
impl<T> std::ops::DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0
            .as_deref_mut()
            .expect("a guard holds its lock outside a wait")
    }
}

/// Loom build: a loom condition variable with parking_lot's `wait_for` (loom does not model the
/// timeout: a wait ends at a notification).
#[cfg(loom)]
pub(crate) struct Condvar(loom::sync::Condvar);

#[cfg(loom)]
impl Condvar {
    pub(crate) fn new() -> Self {
        Self(loom::sync::Condvar::new())
    }

    pub(crate) fn wait_for<T>(&self, guard: &mut MutexGuard<'_, T>, timeout: std::time::Duration) {
        let held = guard
            .0
            .take()
            .expect("a guard holds its lock outside a wait");
        let (held, _) = self
            .0
            .wait_timeout(held, timeout)
            .expect("loom mutex poisoned");
        guard.0 = Some(held);
    }

    pub(crate) fn notify_all(&self) {
        self.0.notify_all();
    }
}

/// Loom build: a loom reader-writer lock with parking_lot's `read()` / `write()` signatures.
#[cfg(loom)]
pub(crate) struct RwLock<T>(loom::sync::RwLock<T>);

#[cfg(loom)]
impl<T> RwLock<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(loom::sync::RwLock::new(value))
    }

    pub(crate) fn read(&self) -> loom::sync::RwLockReadGuard<'_, T> {
        self.0.read().expect("loom rwlock poisoned")
    }

    pub(crate) fn write(&self) -> loom::sync::RwLockWriteGuard<'_, T> {
        self.0.write().expect("loom rwlock poisoned")
    }
}
