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
//! The ledger lives in a `std` thread-local: loom runs all threads of one model on the test's OS
//! thread, and each `#[test]` has its own OS thread. It is only active between [`arm`] and
//! [`disarm`] (objects freed when loom tears an execution down, outside the model, are ignored).

use std::cell::RefCell;
use std::collections::HashMap;

pub use crate::raw::hooks::Kind;

struct Entry {
    kind: Kind,
    shadow: loom::cell::UnsafeCell<()>,
}

#[derive(Default)]
struct Ledger {
    armed: bool,
    live: HashMap<usize, Entry>,
    built: HashMap<Kind, u64>,
    freed: HashMap<Kind, u64>,
}

std::thread_local! {
    static LEDGER: RefCell<Ledger> = RefCell::new(Ledger::default());
}

/// Starts tracking (call first thing inside the `loom::model` closure): clears the ledger.
pub fn arm() {
    LEDGER.with(|l| {
        let mut l = l.borrow_mut();
        *l = Ledger::default();
        l.armed = true;
    });
}

/// Stops tracking (call last thing inside the `loom::model` closure).
pub fn disarm() {
    LEDGER.with(|l| *l.borrow_mut() = Ledger::default());
}

/// Objects of `kind` created since [`arm`].
pub fn built(kind: Kind) -> u64 {
    LEDGER.with(|l| l.borrow().built.get(&kind).copied().unwrap_or(0))
}

/// Objects of `kind` freed since [`arm`].
pub fn freed(kind: Kind) -> u64 {
    LEDGER.with(|l| l.borrow().freed.get(&kind).copied().unwrap_or(0))
}

/// Objects of `kind` created since [`arm`] and not freed yet.
pub fn live(kind: Kind) -> usize {
    LEDGER.with(|l| l.borrow().live.values().filter(|e| e.kind == kind).count())
}

pub(crate) fn created(kind: Kind, addr: usize) {
    LEDGER.with(|l| {
        let mut l = l.borrow_mut();
        if !l.armed {
            return;
        }
        let shadow = loom::cell::UnsafeCell::new(());
        shadow.with_mut(|_| ());
        if let Some(old) = l.live.insert(addr, Entry { kind, shadow }) {
            panic!(
                "loom ledger: {kind:?} created at the address of a live {:?}",
                old.kind
            );
        }
        *l.built.entry(kind).or_default() += 1;
    });
}

pub(crate) fn read(kind: Kind, addr: usize) {
    LEDGER.with(|l| {
        let l = l.borrow();
        if !l.armed {
            return;
        }
        match l.live.get(&addr) {
            Some(e) if e.kind == kind => e.shadow.with(|_| ()),
            _ => panic!("loom ledger: read of a freed or unknown {kind:?} at {addr:#x}"),
        }
    });
}

pub(crate) fn destroyed(kind: Kind, addr: usize) {
    LEDGER.with(|l| {
        let mut l = l.borrow_mut();
        if !l.armed {
            return;
        }
        match l.live.remove(&addr) {
            Some(e) if e.kind == kind => {
                e.shadow.with_mut(|_| ());
                *l.freed.entry(kind).or_default() += 1;
            }
            _ => panic!("loom ledger: free of a freed or unknown {kind:?} at {addr:#x}"),
        }
    });
}

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

/// Model m11: a run reaper's lock-free stack on its own (see `raw/reaper.rs`): two threads
/// push retired runs while the calling thread frees the stack; every run is freed exactly once
/// (the ledger checks it).
pub fn reaper_push_vs_free_all() {
    use crate::raw::block_run::BlockRun;
    use crate::raw::holder::Holder;
    use crate::raw::reaper::Reaper;
    use std::sync::Arc;
    let reaper: Arc<Reaper<BlockRun>> = Arc::new(Reaper::default());
    let new_run = || {
        BlockRun::create(&[Holder::new(0, 1, 16, 1_000, 1)], 1, &[1, 2, 3, 4])
            .expect("run address")
            .as_ptr() as usize
    };
    let (r1, r2, r3) = (new_run(), new_run(), new_run());
    let pusher = |runs: Vec<usize>| {
        let reaper = Arc::clone(&reaper);
        loom::thread::spawn(move || {
            for r in runs {
                // SAFETY: a run of this model's own, pushed once, read by nothing else.
                unsafe { reaper.push(r as *mut BlockRun) };
            }
        })
    };
    let a = pusher(vec![r1, r2]);
    let b = pusher(vec![r3]);
    let mut freed = reaper.free_all();
    a.join().expect("pusher");
    b.join().expect("pusher");
    freed += reaper.free_all();
    assert_eq!(freed, 3, "every run freed once");
    assert!(reaper.is_empty());
}
