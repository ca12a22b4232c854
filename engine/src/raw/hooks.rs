//! The loom seam's hooks into the storage: the points where a loom build records what the
//! engine does with plain memory (see [`crate::raw::loom_api`]'s ledger) and the two parameters
//! a model may set. Outside loom every hook is an empty inline function or a constant, so the
//! product paths are the same code in both builds; only these bodies differ.
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
    crate::raw::loom_api::created(kind, addr);
    #[cfg(not(loom))]
    let _ = (kind, addr);
}

/// The engine dereferences the object of `kind` at `addr`.
#[inline(always)]
pub(crate) fn read(kind: Kind, addr: usize) {
    #[cfg(loom)]
    crate::raw::loom_api::read(kind, addr);
    #[cfg(not(loom))]
    let _ = (kind, addr);
}

/// The object of `kind` at `addr` is freed.
#[inline(always)]
pub(crate) fn destroyed(kind: Kind, addr: usize) {
    #[cfg(loom)]
    crate::raw::loom_api::destroyed(kind, addr);
    #[cfg(not(loom))]
    let _ = (kind, addr);
}
