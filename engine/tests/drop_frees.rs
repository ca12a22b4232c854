//! A dropped index frees what it held, measured by the allocator: records, tables, LFU state and
//! chain runs (regression: when parents held their children strongly, every index that had
//! ingested a key leaked its records and tables, ~6 KB for one key; found by the `engine_ops`
//! fuzz target). The records' ownership has no cycle (`docs/engine.md`, "Identity lifecycle");
//! `index/mod.rs::a_dropped_index_frees_every_record` checks each record by a weak handle.

mod fixed_policy;

use fixed_policy::FixedPolicy;
use inferencecache_engine::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

/// Bytes currently allocated through the global allocator.
static LIVE: AtomicI64 = AtomicI64::new(0);

struct Tracking;
// SAFETY: forwards to the system allocator; the counter is a plain atomic (no allocation).
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as i64, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as i64, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        LIVE.fetch_add(n as i64 - l.size() as i64, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(p, l, n) }
    }
}
#[global_allocator]
static A: Tracking = Tracking;

/// Builds an index, ingests a chain, a legacy key and stats under two models (with `policy`:
/// LFU credits and a tenant quota that evicts), drops it.
fn build_and_drop(policy: FixedPolicy) {
    let credit = policy.alg == Algorithm::Lfu;
    let ix = Index::new(
        IndexConfig::default(),
        Arc::new(policy),
        Arc::new(ManualClock::new(1_700_000_000_000_000)),
    );
    let blocks = [b"b1".to_vec(), b"b2".to_vec()];
    for model in ["m", "n"] {
        ix.ingest(CacheStateUpdate {
            replica_id: "r0",
            model_id: model,
            tenant_id: "t",
            hash_scheme: "vllm",
            timestamp_us: 0,
            adapter_id: "",
            stats: Some(ReplicaStatsInput::default()),
            prefixes: [
                PrefixRef {
                    prefix_hash: &b"p"[..],
                    token_count: 16,
                    block_hashes: &[][..],
                    block_token_counts: &[][..],
                    tier: 0,
                    adapter_id: "",
                },
                PrefixRef {
                    prefix_hash: &[][..],
                    token_count: 0,
                    block_hashes: &blocks[..],
                    block_token_counts: &[16, 16][..],
                    tier: 0,
                    adapter_id: "a",
                },
            ],
        });
    }
    if credit {
        let r = ix.lookup_route(&LookupRequest::<Vec<u8>> {
            prefix_hash: b"p",
            ..LookupRequest::new("t", "n", "vllm")
        });
        for _ in 0..20 {
            ix.credit_hits(&r.hits);
        }
    }
    drop(ix);
}

fn plain() -> FixedPolicy {
    FixedPolicy::lru_or_lfu(false)
}

/// The allocation counter is process-wide: the tests measure one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn dropped_indexes_do_not_accumulate() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Warm up one-time allocations (epoch collector, thread locals).
    for _ in 0..50 {
        build_and_drop(plain());
    }
    let before = LIVE.load(Ordering::Relaxed);
    for _ in 0..2000 {
        build_and_drop(plain());
    }
    let grown = LIVE.load(Ordering::Relaxed) - before;
    // A leak of the records would be several KB per index (> 10 MB here); what may remain is
    // epoch garbage not yet collected, which is bounded.
    assert!(
        grown < 1 << 20,
        "{grown} bytes still live after 2000 dropped indexes"
    );
}

/// The same with a tenant quota that evicts (its quota hand keeps the tenant's partitions, which
/// hold the tenant, between enforcements) and LFU credits (cells, key sums).
#[test]
fn dropped_indexes_with_quota_and_lfu_do_not_accumulate() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let policy = || FixedPolicy {
        quota: Some(1),
        ..FixedPolicy::lru_or_lfu(true)
    };
    for _ in 0..50 {
        build_and_drop(policy());
    }
    let before = LIVE.load(Ordering::Relaxed);
    for _ in 0..2000 {
        build_and_drop(policy());
    }
    let grown = LIVE.load(Ordering::Relaxed) - before;
    assert!(
        grown < 1 << 20,
        "{grown} bytes still live after 2000 dropped indexes"
    );
}

/// Two replicas ingest the same 200-block chain, which one run holds for both
/// it; the dropped index frees its runs with its slot tables.
#[test]
fn dropped_indexes_with_chain_runs_do_not_accumulate() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let blocks: Vec<[u8; 8]> = (0..200u64).map(|i| (0xD0_0000 + i).to_be_bytes()).collect();
    let counts = vec![16; blocks.len()];
    let build_and_drop = || {
        let ix = Index::new(
            IndexConfig::default(),
            Arc::new(plain()),
            Arc::new(ManualClock::new(1_700_000_000_000_000)),
        );
        for replica in ["r0", "r1"] {
            ix.ingest(CacheStateUpdate {
                replica_id: replica,
                model_id: "m",
                tenant_id: "t",
                hash_scheme: "vllm",
                timestamp_us: 0,
                adapter_id: "",
                stats: None,
                prefixes: std::iter::once(PrefixRef {
                    prefix_hash: &[],
                    token_count: 0,
                    block_hashes: &blocks,
                    block_token_counts: &counts,
                    tier: 0,
                    adapter_id: "",
                }),
            });
        }
        assert!(ix.memory_breakdown().runs > 200 * 8, "a run was built");
        drop(ix);
    };
    for _ in 0..50 {
        build_and_drop();
    }
    let before = LIVE.load(Ordering::Relaxed);
    for _ in 0..2000 {
        build_and_drop();
    }
    // What the dropped indexes retired through the epoch (replaced key-table segments: a
    // partition's tables grow from 4 slots) is freed once the epoch's collector gets to it;
    // this thread's bags are handed over and collected first, so what stays is what leaked.
    for _ in 0..256 {
        crossbeam_epoch::pin().flush();
    }
    let grown = LIVE.load(Ordering::Relaxed) - before;
    // A leaked run would be ~3.4 MB here.
    assert!(
        grown < 1 << 20,
        "{grown} bytes still live after 2000 dropped indexes"
    );
}
