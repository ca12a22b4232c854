//! Atomics seam: the engine's own atomics come from here so that a `--cfg loom` build can swap in
//! loom's instrumented types. (The loom build itself is not wired up yet; see `docs/engine.md`.)

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicI64, AtomicPtr, AtomicU16, AtomicU64};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicI64, AtomicPtr, AtomicU16, AtomicU64};

pub(crate) use std::sync::atomic::Ordering;
