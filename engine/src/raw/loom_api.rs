//! Loom-only instrumentation (compiled only with `--cfg loom`; see `loom-tests/`).
//!
//! Loom checks causality for its atomics and for `loom::cell::UnsafeCell` accesses, but not for
//! plain memory reached through raw pointers — and the engine's block runs, LFU cells and key sums
//! are exactly that (allocations published through atomic pointers and freed through
//! crossbeam-epoch). So every such object gets a **shadow cell** in a per-test ledger:
//!
//! - creation is a loom *write* access of the shadow cell (the builder initialises the object);
//! - every engine dereference (a run's header, holder, key and bit reads, LFU cell identity
//!   reads, key sum access) is a loom *read* access;
//! - freeing is a loom *write* access, and the ledger marks the object dead.
//!
//! Loom then reports a causality violation if a reader can see an object whose initialisation
//! does not happen-before the read (a torn / unpublished run: missing Release/Acquire), or if a
//! free is not ordered after every read (use-after-free: broken epoch protection). A read of an
//! object already marked dead, and a double free, panic directly. The ledger also counts
//! creations and frees so a model can check that nothing leaks once every reader has left.
//!
//! The ledger (`raw/hooks.rs`, where the hooks record into it) lives in a `std` thread-local: loom runs all threads of one model on the test's OS
//! thread, and each `#[test]` has its own OS thread. It is only active between [`arm`] and
//! [`disarm`] (objects freed when loom tears an execution down, outside the model, are ignored).

pub use crate::raw::hooks::Kind;
pub use crate::raw::hooks::ledger::{arm, built, disarm, freed, live};

/// One eager collection step on the calling thread: pushes its deferred-garbage bag to the
/// global queue and tries to advance the epoch and free expired bags. A writer that calls this twice right after
/// unlinking can free what it retired while another model thread is still pinned — exactly the
/// window in which a broken epoch protocol would let a reader use freed memory.
pub fn reclaim_step() {
    crossbeam_epoch::pin().flush();
}

/// Collects the epoch garbage retired during the model, until `done()` holds or a bound of
/// rounds is reached; returns the final `done()`. Call on the main model thread after joining
/// every other thread.
///
/// One round pins, flushes (pushes this thread's bag and runs one collection step: the global
/// epoch advances by one when no participant is pinned in an older epoch, and bags sealed two
/// epochs back are freed) and yields. The yield matters: loom's `join` returns as soon as the
/// thread's closure has returned, but the thread's thread-locals — its crossbeam-epoch handle,
/// whose destructor pins, pushes the thread's last bag and unregisters it — are only dropped
/// afterwards, when loom finishes the thread. Yielding lets loom run that tail; without it some
/// interleavings leave the exiting thread pinned in an old epoch while the main thread flushes,
/// the epoch cannot advance and retired objects look leaked.
pub fn collect_garbage(mut done: impl FnMut() -> bool) -> bool {
    for _ in 0..COLLECT_ROUNDS {
        if done() {
            return true;
        }
        crossbeam_epoch::pin().flush();
        loom::thread::yield_now();
    }
    done()
}

/// Upper bound on [`collect_garbage`] rounds: a bag needs two epoch advances, and a collection
/// step frees at most 8 bags; the models retire far fewer.
const COLLECT_ROUNDS: usize = 16;
