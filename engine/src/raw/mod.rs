//! The lock-free storage under the index: per-partition key tables (groups, key nodes, the
//! shard writers, LFU cells), the chain runs lookups step over, the node arenas and the page
//! arrays they are carved from; and the pieces of the run layout the index is to move onto
//! (`slots`, key-inline slots; `block_run`, runs and their ids; `run_store`, one partition's
//! storage on them; see `docs/perf-log.md`, "The run layout").
//!
//! Readers reach everything here through atomic pointers under an epoch guard and never wait;
//! writers serialize per table shard. This room knows nothing of tenants, models, ranking or
//! eviction policy: it stores keys, holders and counts, and reports its own memory. It never
//! imports `index` (checked by `engine/tests/module_graph.rs`).

pub(crate) mod arena;
pub(crate) mod block_run;
pub(crate) mod doubling;
pub(crate) mod hooks;
pub(crate) mod lfu;
#[cfg(loom)]
pub mod loom_api;
pub(crate) mod node;
pub(crate) mod pages;
pub(crate) mod reaper;
pub(crate) mod run_store;
pub(crate) mod runs;
pub(crate) mod slots;
pub(crate) mod table;
pub(crate) mod writer;
