//! The loom seam's hooks into the storage: the points where a loom build records what the
//! engine does with plain memory (see [`crate::raw::loom_api`]'s ledger) and the two parameters
//! a model may set. Outside loom every hook is an empty inline function or a constant, so the
//! product paths are the same code in both builds; only these bodies differ.
//!
//! Loom checks causality for its own atomics and cells, not for memory reached through raw
//! pointers, and key nodes, LFU cells, key sums and chain runs are exactly that. So a loom build
//! tracks each one from [`created`] through every [`read`] to [`destroyed`].

/// Kind of a tracked object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A key node (`raw::node::KeyNode`).
    Node,
    /// An LFU cell (`raw::lfu::LfuCell`).
    LfuCell,
    /// A per-key access sum (`raw::lfu::KeyAccessSum`).
    KeySum,
    /// A chain run (`raw::runs::ChainRun`).
    Run,
    /// A block run of the run layout (`raw::block_run::BlockRun`).
    BlockRun,
}

/// Whether objects are tracked (a loom build): a dropped table then visits its nodes to record
/// their ends, which a normal build frees with their arena chunks without a visit.
pub(crate) const TRACKS_OBJECTS: bool = cfg!(loom);

/// Retirements a writer collects before it hands them to the epoch together. A loom model's
/// writers retire a handful of nodes, so a batch there holds one: each retirement goes through
/// the epoch as soon as its node is unlinked, and the models check exactly that path.
pub(crate) const BATCH_CAPACITY: usize = if cfg!(loom) { 1 } else { 64 };

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

/// The object of `kind` at `addr` is freed (or its memory goes back to an arena).
#[inline(always)]
pub(crate) fn destroyed(kind: Kind, addr: usize) {
    #[cfg(loom)]
    crate::raw::loom_api::destroyed(kind, addr);
    #[cfg(not(loom))]
    let _ = (kind, addr);
}

/// The objects of `kind` at `addrs` end once every reader pinned now has left (their memory
/// goes with a table retired through the epoch at the same time).
#[inline(always)]
pub(crate) fn destroyed_after_epoch(kind: Kind, addrs: Vec<usize>, guard: &crossbeam_epoch::Guard) {
    #[cfg(loom)]
    if !addrs.is_empty() {
        guard.defer(move || {
            for a in addrs {
                crate::raw::loom_api::destroyed(kind, a);
            }
        });
    }
    #[cfg(not(loom))]
    let _ = (kind, addrs, guard);
}

/// An arena served a node from a free list (memory freed earlier through the epoch).
#[inline(always)]
pub(crate) fn reused() {
    #[cfg(loom)]
    crate::raw::loom_api::note_reuse();
}

/// The largest node index a narrow lane may name in a new key table: 24 bits, or 0 when a
/// model asked for wide tables from the start (`loom_api::set_wide_tables`; the models' tables
/// are tiny and would otherwise always be narrow).
#[inline(always)]
pub(crate) fn narrow_limit(natural: u64) -> u64 {
    #[cfg(loom)]
    if crate::raw::loom_api::wide_tables() {
        return 0;
    }
    natural
}
