//! A dropped index frees what it held: the tenant, model and partition records reference each
//! other, and those cycles must be broken on drop (regression: every index that had ingested a
//! key leaked its records and tables, ~6 KB for one key; found by the `engine_ops` fuzz target).

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

struct NoPolicy;
impl Resolvers for NoPolicy {
    fn ttl_ms(&self, _: &str) -> Option<i64> {
        None
    }
    fn algorithm(&self, _: &str) -> Algorithm {
        Algorithm::Lru
    }
    fn quota(&self, _: &str) -> Option<i64> {
        None
    }
}

/// Builds an index, ingests a chain, a legacy key and stats under two models, drops it.
fn build_and_drop() {
    let ix = Index::new(
        IndexConfig::default(),
        Arc::new(NoPolicy),
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
    drop(ix);
}

#[test]
fn dropped_indexes_do_not_accumulate() {
    // Warm up one-time allocations (epoch collector, thread locals).
    for _ in 0..50 {
        build_and_drop();
    }
    let before = LIVE.load(Ordering::Relaxed);
    for _ in 0..2000 {
        build_and_drop();
    }
    let grown = LIVE.load(Ordering::Relaxed) - before;
    // A leak of the records would be several KB per index (> 10 MB here); what may remain is
    // epoch garbage not yet collected, which is bounded.
    assert!(
        grown < 1 << 20,
        "{grown} bytes still live after 2000 dropped indexes"
    );
}
