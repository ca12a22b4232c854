//! InferenceCache index engine.
//!
//! This crate knows nothing of gRPC, HTTP or async runtimes: it is the in-memory index of which
//! replica holds which KV-cache block, plus the ranking that turns a lookup into a routing hint.
//! Rule IDs (K, S, E, L, R, O, V, G, N, C, P) refer to the product spec `index.md`; the design,
//! memory layout and memory-ordering argument are in `docs/engine.md`.

#![warn(missing_docs)]

pub mod checkpoint;
pub mod fingerprint;

mod clock;
mod config;
mod directory;
mod index;
mod raw;
mod replica_id;
mod sink;
mod sync;
mod types;

pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{
    Algorithm, DEFAULT_HOT_ACCESS_THRESHOLD, DEFAULT_MAX_ENTRIES, DEFAULT_SWEEP_INTERVAL_MS,
    DEFAULT_TTL_MS, DefaultResolvers, IndexConfig, PROBE_TENANT, RankerConfig, Resolvers,
};
pub use index::{
    CapturedHits, ChainMatch, Decided, DecisionLog, DumpPartition, DumpedEntry, DumpedStats,
    EvictionReason, Index, IndexDigest, LoadEntry, LoadOutcome, LoadTarget, MatchScratch,
    MemoryBreakdown, PartitionHandle, RecordCounts, RouteBuffer, RouteResult, SLICE, SweepOutcome,
    replica_entry_hash,
};
#[cfg(loom)]
pub use raw::loom_api;

/// The storage's pieces (`docs/engine.md`, "Storage: the run layout"), public for the design
/// probe (`bench/src/bin/layout-probe.rs`) and the loom models; not part of the index's API,
/// and free to change with the layout.
#[doc(hidden)]
pub mod layout {
    pub use crate::raw::block_run::{
        BlockRun, FLAG, HINTS, HintTarget, HintedBlock, MAX_HOLDERS, MAX_LEN, RunIds, ScanStep,
        pack, unpack,
    };
    pub use crate::raw::holder::Holder;
    pub use crate::raw::key::{Keys, digest, long_part};
    pub use crate::raw::reaper::{Reaper, Reclaim};
    pub use crate::raw::run_ids::{IdAllocator, Registered};
    pub use crate::raw::run_store::{EvictReport, IngestReport, RunStore, StoreOptions, Writing};
    pub use crate::raw::slots::{SlotTable, SlotValue, SlotWriter};
}
pub use index::ranking::formulas as rank;
pub use replica_id::ReplicaId;
pub use sink::{ChangeEvent, ChangeKind, ChangeSink};
pub use types::*;
