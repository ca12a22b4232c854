//! The lock-free storage under the index: per partition, the key-inline slot table naming
//! `(run, offset)` (`slots`), the block runs that hold a chain's stretches with their holders
//! (`block_run`), the store that writes and walks them (`run_store`), and the LFU cells of its
//! entries (`lfu`); the key in each form the storage and the index pass around (`key`: digests,
//! long parts, a chain's keys, a key's bytes borrowed and owned), the holder entry they store
//! (`holder`), a box made on first use for what most records never need (`lazy_box`), the reaper
//! that frees retired runs, the page accounting of large blocks, and the
//! loom seam (`hooks`, with `loom_api` its face for the models).
//!
//! Readers reach everything here through atomic pointers under an epoch guard and never wait;
//! writers serialize per partition. This room knows nothing of tenants, models, ranking or
//! eviction policy: it stores keys, holders and counts, and reports its own memory. It never
//! imports `index`, and its files import each other without a cycle (`key`, `holder`, `hooks`,
//! `lazy_box` and `pages` import no other file of the room); both are checked by
//! `engine/tests/module_graph.rs`.

pub(crate) mod block_run;
pub(crate) mod doubling;
pub(crate) mod holder;
pub(crate) mod hooks;
pub(crate) mod key;
pub(crate) mod lazy_box;
pub(crate) mod lfu;
#[cfg(loom)]
pub mod loom_api;
pub(crate) mod pages;
pub(crate) mod reaper;
pub(crate) mod run_ids;
pub(crate) mod run_store;
pub(crate) mod slots;
