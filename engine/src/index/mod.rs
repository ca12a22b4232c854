//! The index: ingest (K), stats and events (S, E), lookups (L), ranking (R), orchestration (O), TTL
//! sweep (V1), aggregates (G) and change notifications (N).
//!
//! Concurrency summary (details in the `raw/` module docs and `docs/engine.md`): readers pin an
//! epoch guard, resolve the partition through a wait-free directory and walk its run store
//! (`raw/run_store/`): a key-table probe names a block run, whose keys the walk compares with
//! the request's, stretch by stretch; they take no lock and never retry. Writers take their
//! partition's writer lock once per chain, write new runs or change runs in place where readers
//! can tell (joins, gone and dead bits), and publish with Release stores. Derived counters are
//! atomics whose deltas writers apply once per (partition, replica) run of an ingest or eviction
//! batch; they may lag an in-flight write and are exact once writes quiesce (C3).
//!
//! This file holds the [`Index`] itself: its fields, constructor, configuration and change sink.
//! Each area of its work is one child module with the types it owns, most of them adding an `impl
//! Index` block: `records` (tenants, models, scopes, partitions), `resolution` (finding and
//! creating them), `ingest`, `counters` (the derived counters' pending deltas and their flush),
//! `removal` (one entry, and sliced removal walks), `events`, `route` (lookups: it resolves the
//! partition, runs `walk`, the longest-prefix match, then `ranking`: scores, R4, R5, pressure
//! and the spec's formulas), `crediting` (LFU credits of captured hits), `reports` (aggregates,
//! reads, memory), `sweep` (TTL and lifecycle), `eviction/` (the cap and quotas: the hand, the
//! walk, the exact path), `dump` (checkpoints), `replicate` and `decision_log` (replicated mode).
//!
//! The files import each other without a cycle (`engine/tests/module_graph.rs`): the `Index`'s
//! fields name only files below it (`records`, `eviction/hand.rs`, `decision_log`), children
//! reach the `Index` through `super`, and a lookup's files depend one way, route → walk →
//! ranking.

mod counters;
mod crediting;
mod decision_log;
mod dump;
mod events;
pub(crate) mod eviction;
mod ingest;
pub(crate) mod ranking;
mod records;
mod removal;
mod replicate;
mod reports;
mod resolution;
mod route;
mod sweep;
#[cfg(test)]
mod testing;
mod walk;

pub use crediting::CapturedHits;
pub use decision_log::{Decided, DecisionLog};
pub use dump::{DumpPartition, DumpedEntry, DumpedStats, LoadEntry, LoadOutcome, LoadTarget};
pub use eviction::EvictionReason;
pub use replicate::{IndexDigest, replica_entry_hash};
pub use reports::{MemoryBreakdown, RecordCounts};
pub use resolution::PartitionHandle;
pub use route::{RouteBuffer, RouteResult};
pub use sweep::SweepOutcome;
pub use walk::{ChainMatch, MatchScratch};

use crate::clock::Clock;
use crate::config::{IndexConfig, Resolvers};
use crate::directory::Directory;
use crate::sink::ChangeSink;
use crate::sync::{AtomicBool, AtomicI64, AtomicU64, Condvar, Mutex, Ordering, RwLock};
#[cfg(loom)]
use crossbeam_epoch as epoch;
use eviction::EVICT_SLOTS;
use records::{GaugeRec, ModelRec, Partition, ScopeRec, StatsRecord, TenantRec};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

pub use crate::raw::run_store::SLICE;

/// The cache-aware routing index.
///
/// Every method takes `&self`: share the index (`Arc<Index>`) between the threads that ingest,
/// look up and sweep. Lookups take no lock.
///
/// # Ingest and look up
///
/// A replica reports the chain of blocks it holds (K14); a lookup walks a request's chain and
/// ranks the replicas by the tokens they hold of its prefix (R1–R5):
///
/// ```
/// use inferencecache_engine::*;
/// use std::sync::Arc;
///
/// let now_us = 1_700_000_000_000_000;
/// let index = Index::new(
///     IndexConfig::default(),
///     Arc::new(DefaultResolvers),
///     Arc::new(ManualClock::new(now_us)),
/// );
/// let blocks: Vec<[u8; 8]> = vec![[1; 8], [2; 8]];
/// let tokens = vec![16, 16];
/// // "r0" holds both blocks, "r1" only the first.
/// for (replica, held) in [("r0", 2), ("r1", 1)] {
///     let outcome = index.ingest(CacheStateUpdate {
///         replica_id: replica,
///         model_id: "llama",
///         tenant_id: "acme",
///         hash_scheme: "vllm-sha256",
///         timestamp_us: now_us,
///         adapter_id: "",
///         stats: None,
///         prefixes: std::iter::once(PrefixRef {
///             prefix_hash: b"",
///             token_count: 0,
///             block_hashes: &blocks[..held],
///             block_token_counts: &tokens[..held],
///             tier: 0,
///             adapter_id: "",
///         }),
///     });
///     assert_eq!(outcome.entries_added, held as u64);
/// }
///
/// let scores = index.lookup(&LookupRequest {
///     block_hashes: &blocks,
///     block_token_counts: &tokens,
///     ..LookupRequest::new("acme", "llama", "vllm-sha256")
/// });
/// // r0 matched 32 tokens, r1 16; each score is scaled by R4's distinguishing power (of the
/// // two serving replicas, one matched 32 or more: 1 − 1/2; both matched 16 or more: 0).
/// let ranked: Vec<(&str, f32)> = scores.iter().map(|s| (&*s.replica_id, s.score)).collect();
/// assert_eq!(ranked, [("r0", 16.0), ("r1", 0.0)]);
/// ```
///
/// # Evict
///
/// An engine that drops blocks says so (E3); the index forgets them for that replica only:
///
/// ```
/// # use inferencecache_engine::*;
/// # use std::sync::Arc;
/// # let now_us = 1_700_000_000_000_000;
/// # let index = Index::new(
/// #     IndexConfig::default(),
/// #     Arc::new(DefaultResolvers),
/// #     Arc::new(ManualClock::new(now_us)),
/// # );
/// # let blocks: Vec<[u8; 8]> = vec![[1; 8], [2; 8]];
/// # let tokens = vec![16, 16];
/// # index.ingest(CacheStateUpdate {
/// #     replica_id: "r0",
/// #     model_id: "llama",
/// #     tenant_id: "acme",
/// #     hash_scheme: "vllm-sha256",
/// #     timestamp_us: now_us,
/// #     adapter_id: "",
/// #     stats: None,
/// #     prefixes: std::iter::once(PrefixRef {
/// #         prefix_hash: b"",
/// #         token_count: 0,
/// #         block_hashes: &blocks[..],
/// #         block_token_counts: &tokens[..],
/// #         tier: 0,
/// #         adapter_id: "",
/// #     }),
/// # });
/// // r0 evicts its second block: a lookup of the chain now matches its first block only.
/// let removed = index.evict_prefixes("acme", "llama", "r0", "", &blocks[1..], now_us);
/// assert_eq!(removed, 1);
/// let scores = index.lookup(&LookupRequest {
///     block_hashes: &blocks,
///     block_token_counts: &tokens,
///     ..LookupRequest::new("acme", "llama", "vllm-sha256")
/// });
/// assert_eq!(scores.len(), 1);
/// assert_eq!((&*scores[0].replica_id, scores[0].matched_tokens), ("r0", 16));
/// ```
///
/// # Checkpoint
///
/// [`checkpoint::write::write_checkpoint`](crate::checkpoint::write::write_checkpoint) dumps
/// the index into any writer while it serves;
/// [`checkpoint::read::restore`](crate::checkpoint::read::restore) checks a checkpoint whole,
/// then loads it into another index:
///
/// ```
/// use inferencecache_engine::checkpoint::{read::restore, write::{WriteOptions, write_checkpoint}};
/// use inferencecache_engine::*;
/// use std::sync::Arc;
///
/// let now_us = 1_700_000_000_000_000;
/// let new_index = || {
///     Index::new(
///         IndexConfig::default(),
///         Arc::new(DefaultResolvers),
///         Arc::new(ManualClock::new(now_us)),
///     )
/// };
/// let index = new_index();
/// let blocks: Vec<[u8; 8]> = vec![[1; 8], [2; 8]];
/// let tokens = vec![16, 16];
/// index.ingest(CacheStateUpdate {
///     replica_id: "r0",
///     model_id: "llama",
///     tenant_id: "acme",
///     hash_scheme: "vllm-sha256",
///     timestamp_us: now_us,
///     adapter_id: "",
///     stats: None,
///     prefixes: std::iter::once(PrefixRef {
///         prefix_hash: b"",
///         token_count: 0,
///         block_hashes: &blocks[..],
///         block_token_counts: &tokens[..],
///         tier: 0,
///         adapter_id: "",
///     }),
/// });
///
/// let mut file = Vec::new();
/// let options = WriteOptions {
///     created_ms: now_us / 1000,
///     stream_seq: 0,
///     blobs: Vec::new(),
/// };
/// let written = write_checkpoint(&index, &mut file, &options).expect("writing to memory");
/// assert_eq!(written.entries, 2);
///
/// let restored = new_index();
/// let report = restore(&restored, std::io::Cursor::new(file)).expect("a whole checkpoint");
/// assert_eq!(report.entries, 2);
/// let request = LookupRequest {
///     block_hashes: &blocks,
///     block_token_counts: &tokens,
///     ..LookupRequest::new("acme", "llama", "vllm-sha256")
/// };
/// assert_eq!(restored.lookup(&request), index.lookup(&request));
/// ```
pub struct Index {
    /// This index among the process's (a route buffer's partition memo names its index).
    id: u64,
    cfg: IndexConfig,
    resolvers: Arc<dyn Resolvers>,
    clock: Arc<dyn Clock>,
    tenants: Directory<TenantRec>,
    models: Directory<ModelRec>,
    scopes: Directory<ScopeRec>,
    parts: Directory<Partition>,
    gauges: Directory<GaugeRec>,
    all_parts: Mutex<Vec<Arc<Partition>>>,
    /// `all_parts.len()`, published after each push, so the cap can see that it has every
    /// partition without taking the mutex on each enforcement.
    all_parts_len: AtomicUsize,
    all_models: Mutex<Vec<Arc<ModelRec>>>,
    /// Held while records are created or reclaimed,
    /// so the sweep never retires a record a creator is linking a child to; it guards the
    /// scheme and adapter names new records share.
    records: Mutex<records::SharedNames>,
    /// `tenant_evictions` of reclaimed tenants (V5's counter must not go back; record lock).
    retired_quota_evictions: Mutex<HashMap<Arc<str>, u64>>,
    /// Distinct keys in the whole index, reserved included (O3 step 1).
    total_keys: AtomicI64,
    storage_entries: AtomicI64,
    reserved_entries: AtomicI64,
    /// `[lru_cap, lru_ttl, lfu_cap, lfu_ttl]`.
    evictions: [AtomicU64; EVICT_SLOTS],
    ingest_blocks: AtomicU64,
    stats_bytes: AtomicI64,
    sink: RwLock<Option<Arc<dyn ChangeSink>>>,
    /// Whether a sink is installed (lets writers skip the sink lock when none is).
    sink_set: AtomicBool,
    /// Whether the cap, quotas and the sweep's TTL removal run here (replicated mode turns it
    /// off on every server but the one that decides: `replicate.rs`). A setting, not part of
    /// any concurrent protocol: a std atomic, outside the loom seam.
    local_eviction: std::sync::atomic::AtomicBool,
    /// Receives the removals local eviction decides (replicated mode's leader).
    decision_log: RwLock<Option<Arc<dyn DecisionLog>>>,
    /// Whether `decision_log` holds a log (written under its write lock).
    decision_log_set: AtomicBool,
    ready: AtomicBool,
    ticker: Mutex<Option<Ticker>>,
    sweep_lock: Mutex<()>,
    /// Victim-selection state of the global cap (V2; see `eviction/`).
    cap_hand: Mutex<eviction::Hand<Partition>>,
    /// Lanes per LFU stripe set (see `raw/lfu.rs`, `LfuCell`).
    stripe_lanes: usize,
    /// The retired runs of every partition, freed by whichever partition's writer takes its
    /// lock next (`raw/reaper.rs`): one reaper for the index, where one per partition was an
    /// `Arc` allocation (24 bytes) of every churned tenant's partition (issue 42).
    run_reaper: Arc<crate::raw::reaper::Reaper<crate::raw::block_run::BlockRun>>,
}

/// The sweep thread of [`Index::start`] and the flag and condition variable that stop it.
pub(super) struct Ticker {
    pub(super) stop: Arc<(Mutex<bool>, Condvar)>,
    pub(super) handle: std::thread::JoinHandle<()>,
}

const STATS_RECORD_BYTES: i64 = std::mem::size_of::<StatsRecord>() as i64 + 48;

impl Index {
    /// A new, empty index. The config is normalized (≤ 0 TTL / interval → defaults).
    pub fn new(config: IndexConfig, resolvers: Arc<dyn Resolvers>, clock: Arc<dyn Clock>) -> Self {
        // Not a synchronization point: only distinct values matter.
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let config_seed = config.eviction_seed;
        Self {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            run_reaper: Arc::default(),
            cfg: config.normalized(),
            resolvers,
            clock,
            tenants: Directory::new(),
            models: Directory::new(),
            scopes: Directory::new(),
            parts: Directory::new(),
            gauges: Directory::new(),
            all_parts: Mutex::new(Vec::new()),
            all_parts_len: AtomicUsize::new(0),
            all_models: Mutex::new(Vec::new()),
            records: Mutex::new(records::SharedNames::default()),
            retired_quota_evictions: Mutex::new(HashMap::new()),
            total_keys: AtomicI64::new(0),
            storage_entries: AtomicI64::new(0),
            reserved_entries: AtomicI64::new(0),
            evictions: Default::default(),
            ingest_blocks: AtomicU64::new(0),
            stats_bytes: AtomicI64::new(0),
            sink: RwLock::new(None),
            sink_set: AtomicBool::new(false),
            local_eviction: std::sync::atomic::AtomicBool::new(true),
            decision_log: RwLock::new(None),
            decision_log_set: AtomicBool::new(false),
            ready: AtomicBool::new(false),
            ticker: Mutex::new(None),
            sweep_lock: Mutex::new(()),
            cap_hand: Mutex::new(eviction::Hand::new(eviction::seed_of(config_seed, 0))),
            stripe_lanes: crate::raw::lfu::stripe_lanes(),
        }
    }

    /// The normalized configuration.
    pub fn config(&self) -> &IndexConfig {
        &self.cfg
    }

    pub(super) fn active_sink(&self, reserved: bool) -> Option<Arc<dyn ChangeSink>> {
        if reserved || !self.sink_set.load(Ordering::Acquire) {
            return None;
        }
        let s = self.sink.read();
        match &*s {
            Some(s) if s.is_active() => Some(s.clone()),
            _ => None,
        }
    }

    /// Installs the change sink (N1). With an inactive sink no event is constructed (N4).
    pub fn set_change_sink(&self, sink: Arc<dyn ChangeSink>) {
        let mut s = self.sink.write();
        *s = Some(sink);
        self.sink_set.store(true, Ordering::Release);
    }

    /// Removes the change sink.
    pub fn clear_change_sink(&self) {
        let mut s = self.sink.write();
        *s = None;
        self.sink_set.store(false, Ordering::Release);
    }
}

impl Drop for Index {
    fn drop(&mut self) {
        if let Some(t) = self.ticker.get_mut().take() {
            *t.stop.0.lock() = true;
            t.stop.1.notify_all();
        }
    }
}

/// Loom models only (`loom-tests/`): internal counters without a public accessor.
#[cfg(loom)]
impl Index {
    /// `serving_n` of scope (tenant, model, scheme): replicas with a serving count > 0.
    pub fn loom_serving_n(&self, tenant: &str, model: &str, scheme: &str) -> i64 {
        self.scope_ref(tenant, model, scheme, &epoch::pin())
            .map_or(0, |s| s.serving_n.load(Ordering::Relaxed))
    }

    /// Frees the runs the epoch has handed to every partition's reaper (what a writer does when
    /// it takes a partition's writer lock); returns how many.
    pub fn loom_reap(&self) -> usize {
        let parts: Vec<Arc<Partition>> = self.all_parts.lock().clone();
        parts.iter().map(|p| p.store.free_retired()).sum()
    }

    /// Distinct runs the partitions' key tables name (the runs the index links).
    pub fn loom_live_runs(&self) -> usize {
        let parts: Vec<Arc<Partition>> = self.all_parts.lock().clone();
        let guard = epoch::pin();
        let mut runs = std::collections::HashSet::new();
        for p in &parts {
            p.store.for_each_key(&guard, |_, run, _| {
                runs.insert(run as *const crate::raw::block_run::BlockRun as usize);
            });
        }
        runs.len()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::config::Algorithm;
    use crate::index::testing::{NOW, Policy};
    use crate::types::*;
    use crossbeam_epoch as epoch;
    use std::sync::Weak;

    /// A dropped index frees every record it held, with no code of its own breaking links:
    /// children keep their parents alive, parents list their children weakly. Weak handles to
    /// every tenant, (tenant, model) pair, scope, partition and gauge, taken before the drop,
    /// all fail to upgrade once the epoch has run what the directories deferred. Records
    /// holding each other strongly (a pair listing its partitions, a tenant its pairs or, through
    /// its quota hand, its partitions) would outlive the index.
    #[test]
    fn a_dropped_index_frees_every_record() {
        let ix = Index::new(
            IndexConfig::default(),
            // Tenant "q" has a quota of 2 keys, so its quota hand works on its partitions.
            Arc::new(Policy {
                algorithm: Algorithm::Lru,
                quota: Some(("q", 2)),
            }),
            Arc::new(ManualClock::new(NOW)),
        );
        let keys: Vec<[u8; 8]> = (0..6u64).map(|k| (0xA0 + k).to_be_bytes()).collect();
        let counts = vec![16i32; keys.len()];
        for (tenant, model, scheme, adapter) in [
            ("a", "m", "s", ""),
            ("a", "m", "s", "lora"),
            ("a", "n", "s", ""),
            ("a", "n", "t", ""),
            ("b", "m", "s", ""),
            ("q", "m", "s", ""),
            ("q", "n", "s", "lora"),
        ] {
            ix.ingest(CacheStateUpdate {
                replica_id: "r0",
                model_id: model,
                tenant_id: tenant,
                hash_scheme: scheme,
                timestamp_us: NOW,
                adapter_id: adapter,
                stats: Some(ReplicaStatsInput::default()),
                prefixes: std::iter::once(PrefixRef {
                    prefix_hash: b"",
                    token_count: 0,
                    block_hashes: &keys[..],
                    block_token_counts: &counts[..],
                    tier: 0,
                    adapter_id: "",
                }),
            });
        }
        let evicted: u64 = ix
            .tenant_evictions()
            .iter()
            .filter(|(t, _)| &**t == "q")
            .map(|(_, n)| n)
            .sum();
        assert!(evicted > 0, "the quota of q ran");
        fn weak_all<T>(d: &Directory<T>) -> Vec<Weak<T>> {
            d.all().iter().map(Arc::downgrade).collect()
        }
        let tenants = weak_all(&ix.tenants);
        let models = weak_all(&ix.models);
        let scopes = weak_all(&ix.scopes);
        let parts = weak_all(&ix.parts);
        let gauges = weak_all(&ix.gauges);
        assert_eq!(
            [
                tenants.len(),
                models.len(),
                scopes.len(),
                parts.len(),
                gauges.len()
            ],
            [3, 5, 6, 7, 2]
        );
        drop(ix);
        fn alive<T>(v: &[Weak<T>]) -> usize {
            v.iter().filter(|w| w.upgrade().is_some()).count()
        }
        let left = || {
            [
                alive(&tenants),
                alive(&models),
                alive(&scopes),
                alive(&parts),
                alive(&gauges),
            ]
        };
        // Unlinked directory nodes and old bucket arrays hold records until the epoch frees
        // them: help it along (bounded in time: other tests' pinned threads hold it back).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while left() != [0; 5] && std::time::Instant::now() < deadline {
            epoch::pin().flush();
            std::thread::yield_now();
        }
        assert_eq!(
            left(),
            [0; 5],
            "records alive after the drop: [tenants, models, scopes, partitions, gauges]"
        );
    }
}
