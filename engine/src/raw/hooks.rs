//! The loom seam's hooks into the storage: the points where a loom build records what the
//! engine does with plain memory (into the ledger below, which `raw/loom_api.rs` shows the
//! models) and the parameter a model may set. Outside loom every hook is an empty inline
//! function or a constant, so the product paths are the same code in both builds; only these
//! bodies differ.
//!
//! Loom checks causality for its own atomics and cells, not for memory reached through raw
//! pointers, and block runs, LFU cells and key sums are exactly that. So a loom build tracks
//! each one from [`created`] through every [`read`] to [`destroyed`].

/// Kind of a tracked object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// An LFU cell (`raw::lfu::LfuCell`).
    LfuCell,
    /// A per-key access sum (`raw::lfu::KeyAccessSum`).
    KeySum,
    /// A block run of the run layout (`raw::block_run::BlockRun`).
    BlockRun,
}

/// The placement seed of every table and scratch set a loom model builds: loom replays a model
/// many times and needs each execution to take the same path, so its tables may not be placed
/// by a per-process random seed (`slots::random_seed`). `None` outside loom.
pub(crate) const FIXED_SEED: Option<u64> = if cfg!(loom) {
    Some(0x5EED_0F10_0A5E_ED00)
} else {
    None
};

/// An object of `kind` at `addr` was initialised (before it is published).
#[inline(always)]
pub(crate) fn created(kind: Kind, addr: usize) {
    #[cfg(loom)]
    ledger::created(kind, addr);
    #[cfg(not(loom))]
    let _ = (kind, addr);
}

/// The engine dereferences the object of `kind` at `addr`.
#[inline(always)]
pub(crate) fn read(kind: Kind, addr: usize) {
    #[cfg(loom)]
    ledger::read(kind, addr);
    #[cfg(not(loom))]
    let _ = (kind, addr);
}

/// The object of `kind` at `addr` is freed.
#[inline(always)]
pub(crate) fn destroyed(kind: Kind, addr: usize) {
    #[cfg(loom)]
    ledger::destroyed(kind, addr);
    #[cfg(not(loom))]
    let _ = (kind, addr);
}

/// The loom build's ledger of tracked objects: one shadow `loom::cell::UnsafeCell` per live
/// object, written at its creation and free and read at every dereference (see
/// `raw/loom_api.rs`, which shows it to the models).
#[cfg(loom)]
pub(crate) mod ledger {
    use super::Kind;
    use std::cell::RefCell;
    use std::collections::HashMap;

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
}
