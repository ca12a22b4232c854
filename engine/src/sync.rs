//! Concurrency seam: the engine's own atomics, the shard writer mutex and the thread-local macro
//! come from here, so that a `--cfg loom` build swaps in loom's instrumented types (see
//! `loom-tests/`). A normal build re-exports the std / parking_lot items unchanged.
//!
//! Under loom, crossbeam-epoch must be built with `--cfg crossbeam_loom` (and its `loom`
//! feature, which `engine/Cargo.toml` enables for `cfg(loom)` builds only) so that pinning,
//! retirement and collection are loom-visible too.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicI64, AtomicPtr, AtomicU16, AtomicU64};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicI64, AtomicPtr, AtomicU16, AtomicU64};

pub(crate) use std::sync::atomic::Ordering;

#[cfg(not(loom))]
pub(crate) use parking_lot::{Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::thread_local;

#[cfg(loom)]
pub(crate) use loom::sync::MutexGuard;
#[cfg(loom)]
pub(crate) use loom::thread_local;

/// Loom build: a loom mutex with parking_lot's `lock()` signature (no poisoning in the API).
#[cfg(loom)]
pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

#[cfg(loom)]
impl<T> Mutex<T> {
    pub(crate) fn new(v: T) -> Self {
        Self(loom::sync::Mutex::new(v))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().expect("loom mutex poisoned")
    }
}
